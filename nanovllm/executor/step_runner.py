"""StepRunner: what runs some steps in place of the model's eager forward, each deciding per step
whether it can: captured CUDA graphs (decode batches with a bucket, executor/cuda_graph.py) and the
CPU's C step (decode, and prefill's layers between the matmuls, executor/cpu_decode.py). ModelRunner
builds them once, where its platform has them (Platform.has_decode_graphs, has_c_decode_step), asks
each in turn, and runs the eager forward where none can."""
import torch

from nanovllm.utils.context import Context


class StepRunner:
    # Whether it runs steps with adapter rows (context.lora: lora/layers.py); others leave those steps
    # to the eager forward.
    runs_lora = False

    def can_run(self, num_tokens: int, context: Context) -> bool:
        """Whether this step (num_tokens input tokens; prefill or decode per context) is one it runs."""
        raise NotImplementedError

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context,
            logits_indices: torch.Tensor | None) -> torch.Tensor | None:
        """The step's logits (of the rows logits_indices picks, all rows when None); None on a
        tensor-parallel rank other than 0."""
        raise NotImplementedError

    def free(self) -> None:
        """Release what it holds (graphs, buffers) at engine exit."""
