"""LoRA adapters (vLLM's enable_lora): requests name an adapter (request.LoRARequest), adapters are
read from PEFT folders and llama.cpp's GGUF adapter files (adapter.py), the scheduler keeps at most
max_loras distinct adapters in flight and gives each a slot (slots.py), and the model's linear
layers add each row's low-rank update from its slot (layers.py)."""
from nanovllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
