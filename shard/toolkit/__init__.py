"""Vendor toolkits live in their own virtual environments and are driven through worker processes."""
