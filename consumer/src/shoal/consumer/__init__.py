"""What runs inside a consumer pod, plus the producer side."""
