"""What operators read: the health probe and the metrics snapshot."""
