"""A torch call on a domain tensor, from rule lookup to the wrapped result."""
