"""The scheduler's side of LoRA: max_loras slots, each holding one adapter while sequences that hold
KV blocks run with it (and keeping it after, until the slot is needed for another). A sequence whose
adapter has no slot and finds none free waits, and so does every sequence behind it: the queue stays
first come, first served, so no request starves behind later ones of resident adapters."""
from nanovllm.engine.sequence import Sequence
from nanovllm.lora.request import LoRARequest


class LoRASlotsBusy(RuntimeError):
    """Every slot runs another adapter's sequences (an embedding call cannot wait in the queue)."""


class LoRASlots:
    def __init__(self, max_loras: int):
        self.table: list[LoRARequest | None] = [None] * max_loras
        self.users = [0] * max_loras
        self.last_used = [0] * max_loras
        self._clock = 0

    def _slot_of(self, request: LoRARequest) -> int | None:
        return next((i for i, held in enumerate(self.table) if held == request), None)

    def _free_slot(self) -> int | None:
        """The least recently used slot no sequence runs with (an empty one first)."""
        free = [i for i in range(len(self.table)) if self.users[i] == 0]
        return min(free, key=lambda i: (self.table[i] is not None, self.last_used[i])) if free else None

    def can_admit(self, seq: Sequence) -> bool:
        request = seq.lora_request
        return request is None or self._slot_of(request) is not None or self._free_slot() is not None

    def acquire(self, seq: Sequence) -> None:
        """Give seq its adapter's slot (the caller checked can_admit)."""
        request = seq.lora_request
        if request is None or seq.lora_slot is not None:
            return
        slot = self._slot_of(request)
        if slot is None:
            slot = self._free_slot()
            assert slot is not None, "acquire() without can_admit()"
            self.table[slot] = request
        self.users[slot] += 1
        self._clock += 1
        self.last_used[slot] = self._clock
        seq.lora_slot = slot

    def release(self, seq: Sequence) -> None:
        if seq.lora_slot is not None:
            self.users[seq.lora_slot] -= 1
            seq.lora_slot = None

    def evict(self, request: LoRARequest) -> bool:
        """Empty the slot holding request if no sequence runs with it; False if one does."""
        slot = self._slot_of(request)
        if slot is None:
            return True
        if self.users[slot]:
            return False
        self.table[slot] = None
        return True

    def row_slots(self, seqs: list[Sequence]) -> list[int]:
        return [-1 if seq.lora_slot is None else seq.lora_slot for seq in seqs]
