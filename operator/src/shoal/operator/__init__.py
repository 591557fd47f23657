"""The kopf operator (see the operator issue)."""
