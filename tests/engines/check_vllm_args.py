"""Parse a vLLM server command line with vLLM's own parser (no server started): exit 0 when vLLM takes it."""
import sys

from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
validate_parsed_serve_args(args)
print(args.tensor_parallel_size, args.pipeline_parallel_size, args.max_model_len, args.max_num_seqs, args.dtype,
      args.enable_prefix_caching, args.distributed_executor_backend, args.gpu_memory_utilization)
