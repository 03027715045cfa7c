"""LoRARequest: which adapter a request runs with, by vLLM's names (`vllm.lora.request.LoRARequest`):
`LoRARequest(lora_name, lora_int_id, lora_path)`."""
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: its name (the server's `model` for it), a positive integer id, and its path (a PEFT
    folder with adapter_config.json and adapter_model.safetensors, or a GGUF adapter file).
    base_model_name: the model it was trained on, for /v1/models (None: the served model)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty str, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must be the adapter's folder or "
                             f"GGUF file, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
