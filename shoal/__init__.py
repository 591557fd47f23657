"""Shoal: elastic consumer groups for NATS JetStream on Kubernetes."""

__version__ = "0.1.0"
