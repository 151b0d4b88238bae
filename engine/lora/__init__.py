"""LoRA adapters on one base model, chosen per request (vLLM's --enable-lora): `config.py` the
flags, `adapter.py` a PEFT adapter directory read and checked against the base, `slots.py` the
adapter slots of each projection and the LoRA delta added after the base linear, `manager.py` the
loaded adapters, which slot holds which, and a step's rows grouped by adapter."""
