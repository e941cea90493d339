"""How weights are held: which weights a stage is built from, and GGUF blocks kept quantized."""
