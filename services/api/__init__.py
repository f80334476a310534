"""The router's endpoints: HTTP (OpenAI-compatible, SGLang-native, /health, /metrics) and gRPC Inference."""
