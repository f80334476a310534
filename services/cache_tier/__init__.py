"""Cache tier: host-memory entry store (with disk spill) served over gRPC."""
