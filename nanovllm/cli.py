"""The `nanovllm` command (console script). `nanovllm serve [MODEL] [options]` runs the OpenAI server
(without MODEL: the default model, SmolLM2-135M-Instruct, fetched and converted on first use);
with --data-parallel-size N, N such servers on one host (entrypoints/replicas.py);
`nanovllm worker MODEL --nnodes N --node-rank K --dist-init-addr HOST:PORT` runs node K >= 1's ranks."""
import argparse
import errno
import importlib.util
import logging
import socket
import sys

from nanovllm.engine_args import EngineArgs
from nanovllm.layers.quantization.block_formats import ONLINE_FORMATS
from nanovllm.utils.cli_args import ArgumentParser, positive_int, print_error


def input_bits(text: str) -> int | str:
    """--cpu-input-bits: "auto" or a number (Config checks which)."""
    return int(text) if text.isdigit() else text


def json_object(text: str) -> dict:
    """--speculative-config: a JSON object (Config checks its fields)."""
    import json
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


# Engine options: (flag, Config field, type, help). Defaults stay Config's own (shown by --help).
_ENGINE_OPTIONS = [
    ("--device", "device", str, "auto, cpu or cuda"),
    ("--dtype", "dtype", str, "auto, float32, bfloat16 or float16"),
    ("--quantization", "quantization", str,
     f"quantize a dense checkpoint's weights at load: {', '.join(ONLINE_FORMATS)} (GGUF block formats; "
     "a .gguf MODEL keeps its own)"),
    ("--cpu-input-bits", "cpu_input_bits", input_bits,
     "CPU block-format kernels' input rounding per group: auto (int8 where that is within 40 dB of the group, "
     "14-bit elsewhere), 14 (14-bit everywhere: as vLLM keeps W8A16 / W4A16 activations in 16 bits) or 8 "
     "(llama.cpp's int8 inputs: fastest, coarsest)"),
    ("--max-num-seqs", "max_num_seqs", int, "most sequences in one step"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int,
     "most tokens in one step, a long prompt's prefill chunk"),
    ("--max-model-len", "max_model_len", int, "longest prompt + completion"),
    ("--kvcache-block-size", "kvcache_block_size", int, "tokens per KV cache block (multiple of 16)"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float, "share of GPU memory to use"),
    ("--cpu-kvcache-bytes", "cpu_kvcache_bytes", int, "KV cache size on CPU, in bytes"),
    ("--tensor-parallel-size", "tensor_parallel_size", int,
     "tensor-parallel ranks: one per GPU on CUDA, processes sharing the cores on CPU"),
    ("--attention-backend", "attention_backend", str, "auto, torch, flash or triton"),
    ("--kv-cache-dtype", "kv_cache_dtype", str,
     "how the KV cache stores K and V: auto (16-bit on CPU, the model's dtype on CUDA), float32, bfloat16, "
     "float16, int8 (llama.cpp's q8_0 blocks), fp8 / fp8_e4m3 / fp8_e5m2 (CPU: every one; CUDA: auto or the "
     "model's dtype)"),
    ("--kv-offloading-backend", "kv_offloading_backend", str,
     "a tier under the prefix cache (vLLM's flag): native (implied by the next two)"),
    ("--kv-offloading-size", "kv_offloading_size", float,
     "GiB of host RAM the tier may hold (vLLM's flag; on CPU a second copy of the cache, rarely worth it)"),
    ("--kv-offloading-dir", "kv_offloading_dir", str,
     "a directory the tier writes every prefix block to: read back after a restart, shared by replicas"),
    ("--kv-offloading-dir-size", "kv_offloading_dir_size", float,
     "GiB the directory may hold (least recently used blocks evicted; default 8)"),
    ("--seed", "seed", int, "engine seed"),
    ("--max-loras", "max_loras", int, "LoRA adapters run in one step (with --enable-lora)"),
    ("--max-lora-rank", "max_lora_rank", int, "the highest rank an adapter may have"),
    ("--max-cpu-loras", "max_cpu_loras", int, "adapters kept read on the host (default: --max-loras)"),
    ("--lora-dtype", "lora_dtype", str, "the adapters' precision: auto (int8 on a CPU over a quantized model, else the model's), float32, bfloat16, float16, int8"),
    ("--speculative-config", "speculative_config", json_object,
     'speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' (prompt lookup; '
     '"prompt_lookup_max" / "prompt_lookup_min" n-gram sizes) or \'{"method": "draft_model", "model": PATH, '
     '"num_speculative_tokens": 4}\' (a model sharing the tokenizer; "quantization" its weight format); '
     '"disable_by_batch_size": no proposals at that many decoding sequences'),
    ("--generation-config", "generation_config", str,
     "sampling defaults for request fields left unset: auto (the model's generation_config.json, a GGUF file's "
     "general.sampling.* metadata; the default model's card settings), vllm (none), or a folder holding a "
     "generation_config.json"),
    ("--override-generation-config", "override_generation_config", json_object,
     'generation_config.json fields that win over the model\'s (vLLM\'s flag): \'{"temperature": 0}\' for greedy '
     'answers by default; \'{"max_new_tokens": N}\' gives requests that set no max_tokens / max_output_tokens N '
     "tokens and caps those that ask for more (unset: a request without a limit runs to the end of the context, "
     "as OpenAI's and vLLM's)"),
    ("--runner", "runner", str, "auto or generate (generation and embeddings), or pooling (embeddings only: "
     "/v1/embeddings; no KV cache beyond one block; generation requests refused)"),
    ("--nnodes", "nnodes", int, "machines the tensor-parallel ranks are spread over"),
    ("--node-rank", "node_rank", int, "this machine's index; >= 1 runs `nanovllm worker`"),
    ("--dist-init-addr", "dist_init_addr", str, "HOST:PORT of node 0's rendezvous (nnodes > 1)"),
    ("--dist-timeout-s", "dist_timeout_s", float, "start-up and collectives give up after this long"),
]
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
# Short aliases (vLLM's, bench.py's) of engine flags.
_ALIASES = {"--tensor-parallel-size": "-tp"}
# Defaults that Config leaves to the platform (None there), as --help states them.
_PLATFORM_DEFAULTS = {
    "kvcache_block_size": "16 on CPU, 256 on CUDA",
    "max_num_batched_tokens": "8192 on CPU, 16384 on CUDA",
    "cpu_kvcache_bytes": "a quarter of the available RAM, at most 8 GiB",
    "dist_init_addr": "none",
    "quantization": "none: the checkpoint's own format",
    "speculative_config": "none: no speculation",
    "override_generation_config": "none",
    "kv_offloading_backend": "none: no tier, unless a size or directory is given",
    "kv_offloading_size": "none: no RAM tier",
    "kv_offloading_dir": "none: no directory",
}


def config_default(dest: str) -> str:
    """Config's default of a field, as --help shows it."""
    import dataclasses

    from nanovllm.config import Config
    if dest in _PLATFORM_DEFAULTS:
        return _PLATFORM_DEFAULTS[dest]
    default = {f.name: f.default for f in dataclasses.fields(Config)}[dest]
    return str(default)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="nanovllm", description="nano-vLLM command line")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default=None,
                       help="HuggingFace checkpoint folder (config.json, *.safetensors, tokenizer); "
                            "default: the default model, SmolLM2-135M-Instruct")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default: %(default)s, loopback only; 0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default: %(default)s)")
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    serve.add_argument("--served-model-name", default=None, help="model name clients ask for (default: MODEL; without MODEL: SmolLM2-135M-Instruct, its cache folder accepted too)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="server and engine logging (default: %(default)s)")
    limits = serve.add_argument_group("request limits (each checked before a request is queued; 400/413 beyond)")
    limits.add_argument("--max-n", type=int, default=128,
                        help="most completions per prompt (n, best_of) (default: %(default)s)")
    limits.add_argument("--max-prompts", type=int, default=1024,
                        help="most prompts, and most completions (prompts x n), in one request (default: %(default)s)")
    limits.add_argument("--max-body-bytes", type=int, default=8 * 2**20,
                        help="largest request body, in bytes (default: %(default)s)")
    chat = serve.add_argument_group("chat options (vLLM's flags)")
    chat.add_argument("--tool-call-parser", default=None, metavar="NAME",
                      help="the model's tool-call format, parsed into tool_calls: hermes (Qwen2.5, Qwen3)")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help='allow tool_choice "auto" (the default when a request has tools); needs --tool-call-parser')
    chat.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                      help="return the model's <think> block apart, as reasoning_content (default: none)")
    chat.add_argument("--trust-request-chat-template", action="store_true",
                      help="accept a chat_template in requests (it runs on the engine's thread)")
    engine = serve.add_argument_group("engine options")
    for flag, dest, type_, help_ in _ENGINE_OPTIONS:
        flags = [flag, _ALIASES[flag]] if flag in _ALIASES else [flag]
        engine.add_argument(*flags, dest=dest, type=type_, default=None,
                            help=f"{help_} (default: {config_default(dest)})")
    engine.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    engine.add_argument("--kvcache-prefault", action="store_true", default=None,
                        help="CPU: map every KV cache page at start-up (steadier first steps, slower start)")
    engine.add_argument("--enable-lora", action="store_true", default=None,
                        help="serve LoRA adapters: --lora-modules, a request's `model` naming one (docs/lora.md)")
    engine.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="adapters served under their own names: name=path (a PEFT folder), or vLLM's JSON "
                        '\'{"name": ..., "path": ..., "base_model_name": ...}\'')
    engine.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        default=None, help="turn prefix caching off")
    _add_data_parallel_options(serve)
    serve.set_defaults(serve_parser=serve)  # replicas.py rebuilds a replica's command from its actions
    # Each command's parser reports a flag it does not know (parse_command_line).
    parser.command_parsers = {"serve": serve, "worker": add_worker_command(commands)}
    return parser


def _add_data_parallel_options(serve: argparse.ArgumentParser) -> None:
    dp = serve.add_argument_group(
        "data parallelism", "N replicas of the engine on this host, each its own `nanovllm serve` process with "
        "1/N of the cores (on CUDA its own GPUs); this process supervises them")
    dp.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                    help="number of replicas (default: %(default)s: no replicas, one server)")
    dp.add_argument("--data-parallel-base-port", type=int, default=None,
                    help="replica i listens on this port + i (default: --port)")
    dp.add_argument("--router", action="store_true",
                    help="also start sglang-router in front of the replicas (pip install sglang-router)")
    dp.add_argument("--router-port", type=int, default=30000, help="the router's port (default: %(default)s)")
    dp.add_argument("--router-policy", default="cache_aware", choices=list(ROUTER_POLICIES),
                    help="how the router picks a replica (default: %(default)s)")


def add_worker_command(commands) -> argparse.ArgumentParser:
    worker = commands.add_parser("worker", help="run the tensor-parallel ranks of node K >= 1 of a multi-node engine")
    worker.add_argument("model", help="the checkpoint folder on this machine (node 0's other settings apply)")
    worker.add_argument("--nnodes", type=int, required=True, help="machines in the engine, as on node 0")
    worker.add_argument("--node-rank", type=int, required=True, help="this machine's index, 1..nnodes-1")
    worker.add_argument("--dist-init-addr", required=True, help="HOST:PORT of node 0's rendezvous")
    worker.add_argument("--dist-timeout-s", type=float, default=600.0,
                        help="how long to wait for node 0 (default: %(default)s)")
    worker.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="logging (default: %(default)s)")
    return worker


def run_worker(args: argparse.Namespace) -> int:
    """Node K >= 1: its ranks, until node 0's engine exits (`nanovllm serve --node-rank K` lands here too)."""
    from nanovllm.distributed.node import run_node

    name = f"nanovllm {args.command}"
    if args.model is None:
        return print_error(name, "MODEL (the checkpoint folder on this machine) is required with --node-rank >= 1")
    try:
        return run_node(args.model, args.nnodes or 1, args.node_rank, args.dist_init_addr,
                        args.dist_timeout_s or 600.0)
    except (ValueError, TypeError) as e:
        return print_error(name, e)
    except RuntimeError as e:  # node 0 unreachable: not a usage mistake
        return print_error(name, e, status=1)


def add_kv_offloading_args(parser: argparse.ArgumentParser) -> None:
    """serve's --kv-offloading-* flags, for bench.py and example.py."""
    for flag, dest, type_, help_ in _ENGINE_OPTIONS:
        if dest.startswith("kv_offloading"):
            parser.add_argument(flag, dest=dest, type=type_, default=None, help=help_)


def kv_offloading_kwargs(args: argparse.Namespace) -> dict:
    return {dest: getattr(args, dest) for _, dest, _, _ in _ENGINE_OPTIONS
            if dest.startswith("kv_offloading") and getattr(args, dest) is not None}


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options given on the command line (unset ones keep Config's defaults)."""
    names = [dest for _, dest, _, _ in _ENGINE_OPTIONS] + ["enforce_eager", "enable_prefix_caching", "kvcache_prefault",
                                                           "enable_lora"]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def check_port(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port, or None when it can: a bind test, made the way
    uvicorn binds (SO_REUSEADDR, so a port left in TIME_WAIT by a stopped server counts as free)."""
    if not 0 <= port <= 65535:
        return f"--port must be in 0..65535, got {port}"
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"--host {host!r} is not an address of this machine ({e.strerror})"
    for family, kind, proto, _, address in addresses:  # "localhost" may mean both ::1 and 127.0.0.1
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return f"port {port} on {host} is already in use; pick another with --port"
                return f"cannot listen on {host}:{port} ({e.strerror}); pick another --host or --port"
    return None


def parse_command_line(argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line; flags no command knows are refused by that command's parser, so the
    one error line names it (`nanovllm serve: error: unrecognized arguments: ...`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.command_parsers.get(args.command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command == "worker" or (args.command == "serve" and args.node_rank):
        return run_worker(args)
    if args.command == "serve":
        try:
            import fastapi  # noqa: F401
            import prometheus_client  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError:
            return print_error("nanovllm serve", "the server extras are missing: pip install 'nano-vllm[server]'")
        try:  # every engine flag's value, before the model is looked for, fetched or loaded
            EngineArgs(args.model, **engine_kwargs(args))
            from nanovllm.entrypoints.lora_routes import lora_module_requests
            lora_modules = lora_module_requests(args.lora_modules)
            if lora_modules and not args.enable_lora:
                raise ValueError("--lora-modules needs --enable-lora")
        except (ValueError, TypeError) as e:
            return print_error("nanovllm serve", e)
        if args.data_parallel_size > 1 or args.router:
            return serve_replicas(args)
        if args.data_parallel_base_port is not None:
            return print_error("nanovllm serve", "--data-parallel-base-port needs --data-parallel-size > 1")
        problem = check_port(args.host, args.port)  # before the model load, which takes seconds
        if problem:
            return print_error("nanovllm serve", problem)
        from nanovllm import LLM
        from nanovllm.entrypoints.limits import ServerLimits
        from nanovllm.entrypoints.openai_server import serve as run_server
        from nanovllm.entrypoints.tool_calls import ChatSettings
        from nanovllm.utils.default_model import DefaultModelError

        try:
            limits = ServerLimits(args.max_n, args.max_prompts, args.max_body_bytes)
            chat = ChatSettings(args.tool_call_parser, args.enable_auto_tool_choice,
                                args.trust_request_chat_template, args.reasoning_parser)
            model = model_path(args)
            llm = LLM(model, **engine_kwargs(args))
            try:
                for request in lora_modules:  # each adapter read and checked before the server listens
                    llm.llm_engine.processor.lora_adapter(request)
            except (ValueError, TypeError):
                llm.exit()
                raise
        except (ValueError, TypeError) as e:  # our validation of the model folder or an engine flag
            return print_error("nanovllm serve", e)
        except DefaultModelError as e:  # the default model could not be fetched: not a usage mistake
            return print_error("nanovllm serve", e, status=1)
        name, aliases = served_names(args, model)
        run_server(llm, name, host=args.host, port=args.port, api_key=args.api_key, log_level=args.log_level,
                   limits=limits, chat=chat, model_aliases=aliases, lora_modules=lora_modules)
    return 0


def serve_replicas(args: argparse.Namespace) -> int:
    """`nanovllm serve --data-parallel-size N`: check every port and the options once, then hand over
    to the supervisor (entrypoints/replicas.py)."""
    from nanovllm.config import Config
    from nanovllm.entrypoints.replicas import replica_ports, run_replicas
    from nanovllm.utils.default_model import DefaultModelError

    if args.router and importlib.util.find_spec("sglang_router") is None:
        return print_error("nanovllm serve", "--router needs sglang-router: pip install sglang-router")
    try:
        ports = replica_ports(args) + ([args.router_port] if args.router else [])
        if len(set(ports)) < len(ports):
            raise ValueError(f"--router-port {args.router_port} is one of the replica ports {ports[:-1]}")
        for port in ports:
            problem = check_port(args.host, port)
            if problem:
                raise ValueError(problem)
        model = model_path(args)
        config = Config(model, **engine_kwargs(args))  # one replica's options, checked before N start
    except (ValueError, TypeError) as e:
        return print_error("nanovllm serve", e)
    except DefaultModelError as e:
        return print_error("nanovllm serve", e, status=1)
    try:
        return run_replicas(args.serve_parser, args, model, config)
    except ValueError as e:  # the platform cannot give every replica its own devices
        return print_error("nanovllm serve", e)


def served_names(args: argparse.Namespace, model: str) -> tuple[str, tuple[str, ...]]:
    """(the name clients ask for, other names accepted): --served-model-name; else, for the default
    model, its name (SmolLM2-135M-Instruct), its cache folder still accepted; else MODEL as given."""
    if args.served_model_name:
        return args.served_model_name, ()
    if args.model is None:
        from nanovllm.utils.default_model import MODEL_DIRNAME
        return MODEL_DIRNAME, (model,)
    return model, ()


def model_path(args: argparse.Namespace) -> str:
    """MODEL as given, else the default model (fetched on first use): its GGUF file on a CPU, its
    converted folder on a GPU; with its model card's sampling defaults unless --generation-config."""
    if args.model is not None:
        return args.model
    from nanovllm.utils.default_model import default_generation_config, default_model, default_model_path

    path = default_model_path() if args.quantization else default_model(device=args.device or "auto")
    logging.getLogger(__name__).info("no MODEL given: serving the default model from %s", path)
    if args.generation_config is None:  # its model card's sampling for requests that leave it unset
        args.generation_config = default_generation_config()
    return path


if __name__ == "__main__":
    sys.exit(main())
