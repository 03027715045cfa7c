"""GenerateProgress: generate()'s progress bar: finished requests, and tokens so a long request shows progress.

LLMEngine.generate makes one per call and feeds it every step's StepOutput.
"""
import time

from tqdm.auto import tqdm

from nanovllm.engine.sequence import Sequence

# A redraw every decode step is one huge line in a log or a pipe: at most two per second.
MININTERVAL_S = 0.5


class GenerateProgress:
    def __init__(self, seqs: list[Sequence], enabled: bool):
        self.pending = {seq.seq_id for seq in seqs}
        self.num_prompt_tokens = 0  # computed, recomputation after preemption included
        self.num_output_tokens = 0
        self.start = time.perf_counter()
        # miniters=0 (not None): tqdm's own adaptive miniters would hold back the token counts
        # of a single long request, whose request count stays 0 until it ends.
        self.bar = tqdm(total=len(seqs), desc="Generating", unit="req", dynamic_ncols=True,
                        mininterval=MININTERVAL_S, miniters=0, disable=not enabled)

    def update(self, finished: list[Sequence], num_tokens: int, num_output_tokens: int) -> None:
        """One step's result; the bar redraws only when MININTERVAL_S passed since its last redraw."""
        if num_tokens > 0:
            self.num_prompt_tokens += num_tokens
        self.num_output_tokens += num_output_tokens
        done = [seq for seq in finished if seq.seq_id in self.pending]
        self.pending.difference_update(seq.seq_id for seq in done)
        if self.bar.disable:
            return
        rate = self.num_output_tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"prompt {self.num_prompt_tokens} tok, output {self.num_output_tokens} tok "
                                 f"({rate:.0f} tok/s)", refresh=False)
        self.bar.update(len(done))

    def close(self) -> None:
        self.bar.close()
