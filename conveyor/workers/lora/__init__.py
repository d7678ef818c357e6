"""Multi-LoRA on the workers: wrapped linears, per-step slot mapping, slot manager."""
