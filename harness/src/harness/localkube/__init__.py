"""The local Kubernetes control plane: real API server and controllers, process pods."""
