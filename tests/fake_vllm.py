"""A stand-in for the parts of vLLM 0.33.0 that ``cispo.rollout.VLLMSampler`` uses, for tests on a CPU.

It runs a Hugging Face model with vLLM's documented semantics (processed log-probs, per-request seeds, stop
tokens, finish reasons, ``load_weights`` by Hugging Face name) and checks what it is given against vLLM
0.33.0's source:

* ``LLM(**kwargs)`` accepts exactly the arguments of ``vllm/entrypoints/llm.py``'s ``LLM.__init__`` and
  ``vllm/engine/arg_utils.py``'s ``EngineArgs`` fields (``LLM_ARGUMENTS``, extracted from the 0.33.0 wheel);
  anything else is a ``TypeError``, as there;
* ``distributed_executor_backend="external_launcher"`` requires ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and reads
  ``RANK`` / ``LOCAL_RANK`` (``ExecutorWithExternalLauncher``, ``vllm/v1/executor/uniproc_executor.py``): the
  engine lands on ``cuda:LOCAL_RANK``; without it, on ``cuda:0`` (``UniProcExecutor._distributed_args``).
  The device is recorded in ``DEVICE_LOG`` (tests record the trainer's ``torch.cuda.set_device`` there too);
* ``collective_rpc(name, ...)`` calls the worker's method or raises ``NotImplementedError`` like
  ``vllm/v1/serial_utils.py``'s ``run_method``; the worker's ``reload_weights(weights_iterator=...,
  weights_path=..., is_checkpoint_format=...)`` is 0.33's (``old_reload=True``: the no-argument one of
  older versions, which re-reads the checkpoint);
* ``SamplingParams(stop=[...], include_stop_str_in_output=...)`` needs ``detokenize=True`` (``_verify_args``); a stop
  string is matched on the output text decoded with the engine's tokenizer (skipping special tokens) as
  ``StopChecker.check_stop_strings`` does, after the length and stop-id checks: finish "stop", ``stop_reason`` the
  string, the *text* cut after it (or before it), the *token ids* never cut (``vllm/v1/engine/detokenizer.py``);
* ``sleep(level=2)`` discards the weights (here: filled with NaN) and keeps the buffers, which ``wake_up``
  restores (``Worker.sleep`` / ``wake_up``, ``vllm/v1/worker/gpu_worker.py``); level 1 keeps the weights.

It proves nothing about vLLM itself, only that cispo passes what 0.33 expects and reacts as it should.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types

import torch
import torch.nn.functional as F
import transformers

VERSION = "0.33.0"
LLM_ARGUMENTS = frozenset("""
additional_config aggregate_engine_logging all2all_backend allow_deprecated_quantization
allowed_local_media_path allowed_media_domains async_scheduling attention_backend attention_config
aux_output_config block_size chat_template code_revision collect_detailed_traces compilation_config
config_format convert cp_kv_cache_interleave_size cpu_distributed_timeout_seconds cpu_offload_gb
cpu_offload_params cudagraph_capture_sizes cudagraph_metrics custom_histogram_buckets data_parallel_address
data_parallel_backend data_parallel_external_lb data_parallel_hybrid_lb data_parallel_multi_port_external_lb
data_parallel_rank data_parallel_rpc_port data_parallel_size data_parallel_size_local
data_parallel_start_rank dbo_decode_token_threshold dbo_prefill_token_threshold dcp_comm_backend
dcp_kv_cache_interleave_size dcp_q_replicate decode_context_parallel_size default_mm_loras device_ids
diffusion_config disable_cascade_attn disable_chunked_mm_input disable_custom_all_reduce
disable_hybrid_kv_cache_manager disable_log_stats disable_nccl_for_dp_synchronization disable_sliding_window
distributed_executor_backend distributed_timeout_seconds download_dir dp_sync_interval dtype
ec_manager_config ec_transfer_config elastic_ep_max_dp_size enable_batch_sharded_sampling
enable_chunked_prefill enable_cumem_allocator enable_dbo enable_elastic_ep enable_ep_weight_filter
enable_eplb enable_expert_parallel enable_fault_tolerance enable_flashinfer_autotune enable_hc_sp
enable_layerwise_nvtx_tracing enable_logging_iteration_details enable_lora
enable_mamba_cache_stochastic_rounding enable_mamba_shared_prefix_checkpoint enable_mfu_metrics
enable_mixed_moe_lora_format enable_mm_embeds enable_mm_processor_stats enable_moe_shared_loras
enable_nccl_comm_suspend enable_prefix_caching enable_prompt_embeds enable_return_routed_experts
enable_shm_tensor_arena enable_sleep_mode enable_tower_connector_lora enable_trace_replay enforce_eager
engram_config eplb_config expert_placement_strategy fail_on_environ_validation fault_tolerance_config
fully_sharded_loras gdn_prefill_backend generation_config gpu_memory_utilization hf_config_path hf_overrides
hf_token ignore_patterns interleave_mm_strings io_processor_plugin ir_op_priority jit_monitor_mode
jit_monitor_verbose kda_decode_backend kda_prefill_backend kernel_config kv_cache_dtype
kv_cache_dtype_skip_layers kv_cache_memory_bytes kv_cache_metrics kv_cache_metrics_sample kv_events_config
kv_offloading_backend kv_offloading_size kv_sharing_fast_prefill kv_transfer_config language_model_only
limit_mm_per_prompt linear_backend load_format log_config_file log_level logging_config logits_processors
logprobs_mode long_prefill_token_threshold long_prefill_token_threshold_adaptive lora_dtype
lora_target_modules mamba_backend mamba_block_size mamba_cache_dtype mamba_cache_mode
mamba_cache_philox_rounds mamba_config mamba_ssm_cache_dtype mamba_ssu_algorithm master_addr master_port
max_cpu_loras max_cudagraph_capture_size max_logprobs max_lora_cls_labels max_lora_rank max_loras
max_model_len max_num_active_seqs max_num_batched_tokens max_num_queued_reqs max_num_queued_tokens
max_num_scheduled_tokens max_num_seqs max_parallel_loading_workers media_io_kwargs mm_device_do_normalize
mm_encoder_attn_backend mm_encoder_attn_dtype mm_encoder_fp8_scale_path mm_encoder_fp8_scale_save_margin
mm_encoder_fp8_scale_save_path mm_encoder_only mm_encoder_tp_mode mm_hasher_algorithm mm_ipc_gpu_memory_gb
mm_processor_cache_gb mm_processor_cache_type mm_processor_device mm_processor_kwargs
mm_shm_cache_max_object_size_mb mm_tensor_ipc model model_class_overrides model_impl
model_loader_extra_config model_weights moe_backend monokernel nnodes node_rank num_gpu_blocks_override
numa_bind numa_bind_cpus numa_bind_nodes offload_backend offload_group_size offload_num_in_group
offload_params offload_prefetch_step optimization_level otlp_traces_endpoint override_generation_config
per_request_spec_decode_metrics performance_mode pipeline_parallel_size pooler_config
prefill_context_parallel_size prefill_schedule_interval prefix_cache_retention_interval
prefix_caching_hash_algo prefix_match_unit profiler_config pt_load_map_location quantization
quantization_config ray_workers_use_nsight reasoning_config reasoning_parser reasoning_parser_plugin
renderer_num_workers replayssm_buffer_len return_sampling_mask revision runner safetensors_load_strategy
safetensors_prefetch_block_size safetensors_prefetch_num_threads scheduler_cls scheduler_reserve_full_isl
scheduling_policy seed served_model_name show_hidden_metrics_for_version shutdown_timeout skip_mm_profiling
skip_tokenizer_init sleep_mode_backend sleep_mode_offload_cudagraph sleep_preserve_parameter_names
sparse_indexer_topk_backend spec_method spec_model spec_tokens specialize_active_lora speculative_config
stream_interval structured_outputs_config swa_bounded_replay tensor_parallel_size tokenizer tokenizer_mode
tokenizer_revision tokens_only trust_remote_code ubatch_size use_fp64_gumbel use_replayssm use_tqdm_on_load
video_pruning_method video_pruning_rate watchdog_config watermark watermark_config weight_transfer_config
worker_cls worker_extension_cls
""".split())
"""Every keyword ``vllm.LLM`` 0.33.0 accepts (its own parameters and ``EngineArgs``' public fields)."""

DEVICE_LOG: list[tuple[str, str]] = []
"""("engine", device) when an engine is built; tests add ("trainer", device) for ``torch.cuda.set_device``."""


def load_hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class Completion:
    index: int
    token_ids: list
    logprobs: list
    finish_reason: str
    stop_reason: int | None = None
    text: str = ""


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list
    outputs: list


class SamplingParams:
    def __init__(self, n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_tokens=16,
                 logprobs=None, seed=None,
                 stop_token_ids=None, ignore_eos=False, detokenize=True, stop=None, include_stop_str_in_output=False):
        self.__dict__.update(locals())
        del self.__dict__["self"]
        if stop and not detokenize:  # SamplingParams._verify_args
            raise ValueError("stop strings are only supported when detokenize is True. "
                             "Set detokenize=True to use stop.")


def check_stop_strings(text: str, new_chars: int, stop: list, include_in_output: bool):
    """vLLM's ``StopChecker.check_stop_strings``: (the stop string that ends in the last ``new_chars``
    characters of ``text``, where to cut the text: -1 none), or None. The text is cut after the stop
    string (``include_in_output``) or before it; the token ids are never cut."""
    for s in stop:
        at = text.find(s, 1 - new_chars - len(s))
        if at == -1:
            continue
        if include_in_output:
            at += len(s)
            if at >= len(text):
                return s, -1
        return s, at
    return None


class EngineModel(torch.nn.Module):
    """Like a vLLM model: ``load_weights`` takes (Hugging Face name, tensor) and fails on unknown names."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf
        self.loaded: list[str] = []

    def load_weights(self, weights):
        params = self.hf.state_dict()
        for name, t in weights:
            params[name].copy_(t)  # KeyError on a name the engine does not have
            self.loaded.append(name)
        return set(self.loaded)


class Worker:
    def __init__(self, llm, old_reload: bool):
        self.llm = llm
        self.model_runner = types.SimpleNamespace(model=llm.engine_model, get_model=lambda: llm.engine_model)
        if old_reload:  # before weights_iterator: reload from the checkpoint only
            self.reload_weights = lambda: self._reload(None, None)

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        self._reload(weights_iterator, weights_path)

    def _reload(self, weights_iterator, weights_path):
        self.llm.calls.append(("reload_weights", "iterator" if weights_iterator is not None else "disk"))
        if weights_iterator is None:
            weights_iterator = load_hf(weights_path or self.llm.kwargs["model"]).state_dict().items()
        with torch.no_grad():
            self.llm.engine_model.load_weights(weights_iterator)


class _LoggedCalls(list):
    """The engine's calls; with ``FAKE_VLLM_LOG`` set (a subprocess's engine), also appended to that file as
    JSON lines, with the rank."""

    def __init__(self, llm):
        super().__init__()
        self.path = os.environ.get("FAKE_VLLM_LOG")

    def log(self, item) -> None:
        if self.path:
            import json

            with open(self.path, "a") as f:
                f.write(json.dumps({"rank": os.environ.get("RANK", "0"), "call": item}, default=str) + "\n")

    def append(self, item) -> None:
        super().append(item)
        if not isinstance(item, list):  # SamplingParams lists: not logged
            self.log(item)


class LLM:
    def __init__(self, model, multiprocess=False, old_reload=False, **kwargs):
        unknown = set(kwargs) - LLM_ARGUMENTS
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        self.kwargs = dict(model=model, **kwargs)
        self.env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                   "VLLM_ENABLE_V1_MULTIPROCESSING")}
        dist = torch.distributed
        self.process_group = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", "set VLLM_ENABLE_V1_MULTIPROCESSING=0"
            self.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        else:
            self.device = "cuda:0"
        DEVICE_LOG.append(("engine", self.device))  # the worker makes it the current device
        self.engine_model = EngineModel(load_hf(model))
        self.worker = Worker(self, old_reload)
        cfg = self.engine_model.hf.config
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(
            max_model_len=kwargs.get("max_model_len") or cfg.max_position_embeddings))
        if not multiprocess:  # the V1 LLMEngine exposes model_executor only when in process
            self.llm_engine.model_executor = types.SimpleNamespace(
                driver_worker=types.SimpleNamespace(worker=self.worker))
        self.global_gen = torch.Generator().manual_seed(kwargs.get("seed", 0))
        self.calls: list = _LoggedCalls(self)
        self._saved_buffers: dict = {}
        self._tokenizer = None  # loaded at the first detokenized request (stop strings)
        self.calls.log({"built": {k: v for k, v in self.kwargs.items() if k != "hf_overrides"},
                        "hf_overrides": self.kwargs.get("hf_overrides"), "env": self.env, "device": self.device,
                        "process_group": self.process_group})

    # vLLM's V1 sampler (vllm/v1/sample/sampler.py): penalties (repetition: prompt and output tokens, positive
    # logits divided, others multiplied), greedy for T < 1e-5 (penalised, untempered), else temperature, min_p
    # (p < min_p * p_max dropped), top-k (below the k-th value dropped), top-p (ascending sort, drop cumsum <= 1 - p,
    # the last kept), sample; processed logprobs = log_softmax of the final (truncated) logits.
    @torch.no_grad()
    def _step(self, ids, sp, gen):
        logits = self.engine_model.hf(torch.tensor([ids])).logits[0, -1].float()
        if not torch.isfinite(logits).all():
            raise RuntimeError("the engine's weights are garbage (woken from sleep level 2 without a reload)")
        raw = F.log_softmax(logits, -1)
        if sp.repetition_penalty != 1.0:
            hit = torch.zeros_like(logits, dtype=torch.bool)
            hit[torch.tensor(ids, dtype=torch.long)] = True  # prompt_mask | output_mask
            logits = torch.where(hit & (logits > 0), logits / sp.repetition_penalty, logits)
            logits = torch.where(hit & (logits <= 0), logits * sp.repetition_penalty, logits)
        if sp.temperature < 1e-5:
            tok = int(logits.argmax())
            lp = F.log_softmax(logits, -1) if self.kwargs.get("logprobs_mode") == "processed_logprobs" else raw
            return tok, float(lp[tok])
        x = logits / sp.temperature
        if sp.min_p > 0:
            p = x.softmax(-1)
            x = x.masked_fill(p < sp.min_p * p.max(), -math.inf)
        if sp.top_k > 0:
            x = x.masked_fill(x < x.topk(min(sp.top_k, x.numel())).values[-1], -math.inf)
        if sp.top_p < 1.0:
            s, idx = x.sort(descending=False)
            drop = s.softmax(-1).cumsum(-1) <= 1 - sp.top_p
            drop[-1] = False
            x = x.scatter(0, idx, s.masked_fill(drop, -math.inf))
        processed = F.log_softmax(x, -1)
        tok = int(torch.multinomial(processed.exp(), 1, generator=gen))
        lp = processed if self.kwargs.get("logprobs_mode") == "processed_logprobs" else raw
        return tok, float(lp[tok])

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append(sampling_params)
        outs = []
        for prompt, sp in zip(prompts, sampling_params):
            gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else self.global_gen
            ids, toks, lps, reason, stop_reason = list(prompt["prompt_token_ids"]), [], [], None, None
            eos, text = self.engine_model.hf.config.eos_token_id, ""
            while reason is None:
                tok, lp = self._step(ids + toks, sp, gen)
                toks.append(tok)
                lps.append({tok: Logprob(lp, rank=1)})
                if len(toks) >= sp.max_tokens:  # vLLM checks the length first
                    reason = "length"
                elif tok in (sp.stop_token_ids or []):
                    reason, stop_reason = "stop", tok
                elif not sp.ignore_eos and tok == eos:
                    reason = "stop"
                if sp.stop and reason != "stop":  # then the detokenizer's stop strings (on the output text only)
                    text, reason, stop_reason = self._stop_strings(toks, text, sp, reason, stop_reason)
            outs.append(RequestOutput(ids, [Completion(0, toks, lps, reason, stop_reason, text)]))
        return outs

    def _stop_strings(self, toks, text, sp, reason, stop_reason):
        """The output text after ``toks[-1]`` and, where it completes one of ``sp.stop`` (vLLM's
        ``IncrementalDetokenizer.update``), finish "stop" with the string as ``stop_reason``, the text cut."""
        if self._tokenizer is None:
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(str(self.kwargs.get("tokenizer") or
                                                                             self.kwargs["model"]))
        new = self._tokenizer.decode(toks, skip_special_tokens=True)
        hit = check_stop_strings(new, len(new) - len(text), list(sp.stop or []), sp.include_stop_str_in_output)
        if hit is None:
            return new, reason, stop_reason
        return (new if hit[1] == -1 else new[: hit[1]]), "stop", hit[0]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if isinstance(method, str):
            fn = getattr(self.worker, method, None)
            if fn is None:
                raise NotImplementedError(f"Method {method!r} is not implemented.")
        else:
            fn = lambda *a, **k: method(self.worker, *a, **k)  # noqa: E731
        return [fn(*args, **(kwargs or {}))]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append("reset_prefix_cache")
        return True

    def sleep(self, level=1, mode="abort"):
        self.calls.append(("sleep", level))
        if level == 2:  # weights discarded, buffers kept (Worker.sleep saves them)
            hf = self.engine_model.hf
            self._saved_buffers = {k: b.clone() for k, b in hf.named_buffers()}
            with torch.no_grad():
                for p in hf.parameters():
                    p.fill_(float("nan"))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        if (tags is None or "weights" in tags) and self._saved_buffers:
            for k, b in self.engine_model.hf.named_buffers():
                b.copy_(self._saved_buffers[k])
            self._saved_buffers = {}
        return True


class ModelConfig:
    """``vllm.config.ModelConfig``: 0.33's reads ``hf_overrides["head_dtype"]`` through this property."""

    @property
    def head_dtype(self):
        return torch.float32


def modules(logprobs_mode=True, multiprocess=False, head_dtype=True, old_reload=False, version=VERSION) -> dict:
    """``sys.modules`` entries for a stand-in vLLM: ``logprobs_mode`` / ``head_dtype`` False model a vLLM
    without those engine features; ``old_reload`` one whose ``reload_weights`` takes no weights."""
    vllm = types.ModuleType("vllm")
    vllm.__version__ = version
    vllm.LLM = lambda **kw: LLM(multiprocess=multiprocess, old_reload=old_reload, **kw)
    vllm.SamplingParams = SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kw: dict(kw)
    engine = types.ModuleType("vllm.engine")
    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    names = sorted(LLM_ARGUMENTS - ({"logprobs_mode"} if not logprobs_mode else set()))
    arg_utils.EngineArgs = dataclasses.make_dataclass("EngineArgs", [(n, object, None) for n in names])
    config = types.ModuleType("vllm.config")
    config.ModelConfig = ModelConfig if head_dtype else type("ModelConfig", (), {})
    vllm.inputs, vllm.engine, vllm.config, engine.arg_utils = inputs, engine, config, arg_utils
    return {"vllm": vllm, "vllm.inputs": inputs, "vllm.engine": engine, "vllm.engine.arg_utils": arg_utils,
            "vllm.config": config}


SITECUSTOMIZE = "import sys, fake_vllm\nsys.modules.update(fake_vllm.modules())\n"
"""A ``sitecustomize.py`` that installs the stand-in in a subprocess (tests/ and its folder on PYTHONPATH)."""


def install(monkeypatch, **kw) -> None:
    """Put the stand-in into ``sys.modules`` for the test (``monkeypatch``: pytest's, or ``pytest.MonkeyPatch``)."""
    for name, mod in modules(**kw).items():
        monkeypatch.setitem(sys.modules, name, mod)
