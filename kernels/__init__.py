"""HybridCache kernels: one folder per op family, a pure-PyTorch reference beside each fast kernel."""
