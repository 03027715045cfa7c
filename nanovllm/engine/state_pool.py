"""StatePool: the state layers' slots (layers/sequence_state.py: linear attention, short
convolutions, Mamba-2), one per sequence holding blocks; the KV cache manager admits a sequence only
with a free one."""


class StatePool:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free_slots: list[int] = list(range(num_slots))

    def can_take(self) -> bool:
        return not self.num_slots or bool(self.free_slots)

    def take(self) -> int | None:
        """A free slot (None where the model keeps no state). NOTE: the slot's old contents are
        never read: the sequence's first step starts from zero state."""
        return self.free_slots.pop() if self.num_slots else None

    def free(self, slot: int | None) -> None:
        if slot is not None:
            self.free_slots.append(slot)
