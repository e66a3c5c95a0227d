"""Fine-tuning users' Hugging Face decoders and VLMs (train extra: torch, transformers, peft).

What it makes is what the torch-free toolchain already consumes: a PEFT LoRA adapter directory, with the learned
head gates beside it (`head_gates.json`), merged and folded by the `lora` pass (`edgekit.passes.lora`).
"""
