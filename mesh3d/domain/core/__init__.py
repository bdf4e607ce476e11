"""What a domain tensor is: its layout's spec, its group as plain data, the split rule and the settings."""
