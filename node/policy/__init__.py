"""The policy: the model and everything that runs it.

Owns building models and tokenizers from the run spec (``model``, ``hf`` for Hugging Face folders and SmolLM2),
generation with seeded sampling and TOPLOC proofs (``generate``) behind the backend interface (``backend``),
the GRPO training engine (``engine``) and its FSDP2 variant under torchrun (``fsdp``), low-rank adapters
(``lora``) and AdamW with bf16 moments (``optim``).

May import: ``intellect_kernels``, ``intellect_protocol``; no other subsystem, no role.
"""
