"""CosyVoice 2 inference, our own PyTorch implementation (spec: shared/specs/cosyvoice2.md)."""
