"""Which rows a sliding-window op needs, and the interior computed while they travel."""
