"""Every efficiency factor, overhead and switch cost of the cost model, with where it comes from.

An analytic cost is FLOPs / (peak x efficiency) or bytes / (bandwidth x efficiency). The efficiencies
below are fitted so that the three published runs of the calibration scenarios land on their measured
step times and phase shares (tests/test_calibration.py recomputes them through the simulator):

  [QI]  veRL-Omni docs, "Performance Reference", FlowGRPO non-CFG full-model training on Qwen-Image
        OCR: 4x H200, 32 prompts x 16 images = 512 images/step, 250 s/step, 0.510 images/GPU/s.
        Recipe (examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr.sh): 512x512, 10 denoising
        steps (rollout default), true_cfg_scale 1.0, SDE window of 2 trained steps, mini-batch 16
        prompts (2 optimizer steps), actor param + optimizer offload, Qwen3-VL-8B OCR judge (TP 4).
  [WAN] veRL-Omni, Wan2.2 FlowGRPO, colocated, on Ascend 910B-class NPUs: step 2160 s = generation
        869 s + old log-prob 549 s + actor update 735 s + weight update 6.8 s (+ the rest).
        The workload behind the figure is not published with it. Assumed (calib-wan22-colocated):
        8x Ascend 910B, Wan2.2-T2V-A14B (two 14B experts, one active per step), 12 prompts x 4
        videos, 480x832x33 frames, 20 denoising steps, CFG in rollout only (DanceGRPO-style
        training), half the timesteps trained, KL to a reference (its forward counted in "old
        log-prob"). Under these, old/generation = 0.63 and update/old = 1.34 follow from the same
        forward/backward efficiencies as [QI]; only the Ascend factor below is fitted to [WAN].
  [LLM] verl, Qwen3-4B-Instruct GRPO on GSM8K, 4 GPUs, TP 4, n = 4, responses up to 8192 tokens:
        step 129.1 s = generation 59.0 s + actor update 35.6 s + reference 18.2 s + old log-prob 12.2 s.
        Hardware not stated with the figure: we assume 4x H100 SXM (verl's reference machine).

  [DG]  DanceGRPO on FLUX.1-dev, 32 GPUs over 4 nodes: 291.284 s per iteration; [MG] MixGRPO on the same: 151 s
        (MixGRPO, arXiv 2507.21802, as its summaries quote it; calib-dancegrpo-flux-32xh800.yaml and
        calib-mixgrpo-flux-32xh800.yaml hold the recipes and assume H800, chosen after seeing the figures).
        Only `fastvideo_exposed_fraction` is fitted to them.

  [QI64] veRL-Omni docs, same page, "FlowGRPO non-CFG Full Model: VeOmni vs FSDP1 Backend": the [QI] recipe
        on 64x H100 (8 nodes), FSDP1: 105 s/step, 0.077 images/GPU/s. The page does not name the cluster's NICs:
        its scenario's `cluster.network_gbps` is fitted to the step (calib-qwenimage-64xh100.yaml); no factor of
        this file is. Its VeOmni-backend row (100 s, calib-qwenimage-veomni-64xh100) runs on the same fitted network,
        so it is a fitted point too: it checks the training engine, not the network.

Held out (no factor fitted to them; tests/test_calibration_published.py checks them within 20 %): veRL-Omni's
Qwen-Image LoRA runs on 4 and 5 H800 (420 s, 360 s), NeMo RL v0.4's GRPO of Llama-3.1-8B on 16 H100 (97.7 s) and
Qwen3-32B on 32 H100 (393 s), and a vLLM decode sweep of Llama-3.1-8B on one A100 40GB (tests/test_cost_structure.py).
Held out beside them, not within a measured bound: DanceGRPO's own FLUX recipes on 16 and 8 H800
(calib-dancegrpo-flux-16xh800: an upper bound of 216 s, not passed; calib-dancegrpo-flux-8xh800: "about 8 minutes",
missed by a third; BENCHMARKS.md says why no per-pass factor reconciles it with [DG] / [MG], and that DanceGRPO's
8-GPU script and code, read at the remark's date, hold no mechanism the 16- and 32-GPU runs lack: the same work per
image, on one node, with fewer optimizer steps; the README of that date bounds the same setting at 432 s).
Where the public record is silent the assumption is written next to the factor it affects; the
scenario YAMLs (dovetail/scenarios/calib-*.yaml) hold the workload assumptions and each run's source.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Calibration:
    # --- language models (fitted to [LLM]) -----------------------------------------------------
    # vLLM prefill is compute-bound; 0.45 of peak is typical of chunked prefill at 8k-token chunks.
    # Prefill is < 2 % of [LLM]'s generation time, so this factor is weakly constrained by it.
    prefill_mfu: float = 0.45
    # Decode FLOPs / peak when many sequences share a step. [LLM]: 4096 responses of GSM8K length
    # finish in the first ~25 s of a 59 s generation; the rest is the single 8192-token tail.
    decode_mfu: float = 0.30
    # Fraction of HBM bandwidth a decode step achieves reading weights and KV cache.
    decode_bandwidth_efficiency: float = 0.70
    # Fixed cost of one decode iteration per layer besides its two tensor-parallel all-reduces (which the
    # cost model charges on the engine's link, `CostModel.allreduce_seconds`): kernel launches, norms,
    # sampling. verl's rollout runs vLLM with enforce_eager=True (no CUDA graphs), so launches dominate.
    # [LLM]: the longest response (8192 tokens) alone sets ~33 s of the 59 s generation after the bulk
    # finishes, i.e. ~4.0 ms per iteration for 36 layers at TP 4 where bandwidth accounts for < 1 ms and the
    # NVLink all-reduces for ~0.3 ms. A server with CUDA graphs (vLLM's default) pays ~0 here.
    decode_layer_overhead_s: float = 100e-6
    # Share of device memory the rollout engine may use (verl's rollout.gpu_memory_utilization
    # default is 0.5; [LLM] recipe uses 0.6); the KV cache gets what the weights leave of it.
    rollout_memory_fraction: float = 0.6
    # FSDP forward-only (old / reference log-prob) efficiency: [LLM] old log-prob 12.2 s over the
    # batch's ~2.1 M tokens on 4 devices. (This and the two factors around it were refitted, from 0.345, 0.47
    # and 125 us, when tensor-parallel all-reduces were charged on the link: [LLM] +7.9 % of its step.)
    logprob_mfu: float = 0.365
    # FSDP forward+backward with gradient checkpointing: [LLM] actor update 35.6 s (35.8 predicted), i.e. 4 forwards
    # (3x training + 1 recompute) at this efficiency.
    train_mfu: float = 0.50
    # verl places the reference model with param_offload=True: each forward pass streams the
    # weights in from host memory. [LLM]: reference 18.2 s vs old log-prob 12.2 s -> 1.5x.
    reference_offload_factor: float = 1.49
    # Rule-based reward (GSM8K answer match), seconds per sample on the driver.
    rule_reward_s_per_sample: float = 2e-4

    # --- diffusion transformers (fitted to [QI] and [WAN]) -------------------------------------
    # [QI] at 250 s/step: generation of 512 images x 10 steps of a 1280-token (1024 latent + 256
    # text) 20B MMDiT is ~2.7e17 FLOP; with the update (1024 trained pairs) and the OCR judge the
    # step fits only if the rollout engine (vLLM-Omni, step-wise batching) runs at ~0.6 of peak ...
    # (0.63 since the trainer's wake / sleep moves its host-offloaded state too: [QI] went from +7 % to +9 % at 0.60.)
    dit_inference_mfu: float = 0.63
    # ... and FSDP forward+backward (4 forwards with recompute) at 0.62 for large passes. Refitted when
    # per-pass FSDP traffic and the small-pass curve were added (below): [QI] (16 images x 1280 tokens per
    # pass) lands at +7 % of its step and [WAN]'s actor update (one 14040-token video per pass) at +19 %
    # with it; 0.55 left [QI] at +12 % and [WAN] at +12 % with its update share 7 pp too high.
    dit_train_mfu: float = 0.62
    # Forward-only recompute of old log-probs in the FSDP actor (same kernels as training, no
    # backward overlap to hide FSDP all-gathers).
    dit_logprob_mfu: float = 0.50
    # The two factors above are the large-pass limit: a trainer pass holding t tokens (pairs x latent
    # tokens, x2 with CFG) runs at mfu x t / (t + dit_half_mfu_tokens) — small-batch under-utilisation
    # (GEMMs with few rows, fixed per-layer launch and norm/attention-kernel overheads). The three
    # diffusion calibration runs both hold >= 14k tokens per pass (where the curve is within 4 % of its limit), so
    # they do not constrain the half point; 512 tokens is an assumption (H100 bf16 GEMMs of a 3072-wide
    # DiT layer reach about half their large-M throughput at M ~ 512 in public cuBLAS sweeps).
    dit_half_mfu_tokens: float = 512.0
    # fastvideo's FSDP (DanceGRPO, MixGRPO: XueZeyue/DanceGRPO fastvideo/utils/fsdp_util.py on main, unchanged since
    # 93ec253: MixedPrecision with param_dtype fp32, FULL_SHARD, limit_all_gathers, no forward_prefetch (that is only
    # in 22b85ef, the unmerged pull request 44); fastvideo/train_grpo_flux.py runs every sampling forward
    # (run_sample_step, one image per pass: sample_reference_model's batch_size = 1) and every training pass
    # (grpo_one_step, one image at one timestep) under torch.autocast bf16): the fraction of the shorter of a
    # pass's compute and its fp32 all-gathers / reduce-scatters that the overlap does not hide
    # (`CostModel.fsdp_pass_seconds`). Fitted to [DG] / [MG] (291.284 s / 151 s on 32 GPUs over 4 nodes,
    # calib-dancegrpo-flux-32xh800, calib-mixgrpo-flux-32xh800: -2.7 % / +3.3 % at 0.25; 0.30 fits [DG] alone,
    # 0.19 [MG] alone; 0 left them at -16.0 % / -10.1 %). Those two runs' H800 was chosen after seeing their
    # figures, so they are fitted points, not checks. No bf16 FSDP trainer (verl's) pays it: the other runs are
    # untouched.
    fastvideo_exposed_fraction: float = 0.25
    # Text encoders and VAE decoders run at low batch and small shapes.
    encoder_mfu: float = 0.25
    # Kernel efficiency of a device relative to the Hopper-fitted factors above, by catalogue name (1.0 if
    # absent). Ascend 910B, fitted to [WAN]: 48 videos x 20 steps x 2 (CFG) forwards of 14040 latent tokens
    # (5.6e14 FLOP each) in 869 s on 8 NPUs. A100 and L40S carry their own peaks (L40S: the fp32-accumulate
    # figure) and no further factor.
    device_efficiency: dict[str, float] = field(default_factory=lambda: {"Ascend-910B": 0.80})
    # Vision-language judge (OCR reward, Qwen3-VL-8B on vLLM): seconds per image per device, fitted
    # to the residual of [QI] after generation, log-prob and update.
    vlm_reward_s_per_image_device: float = 0.10

    # --- per-pass costs of an FSDP (ZeRO-3) trainer: what one forward/backward pays whatever it holds --
    # Each forward all-gathers the bf16 parameters, each backward all-gathers them again and
    # reduce-scatters the gradients; prefetch overlaps them with compute, so a pass takes the longer of
    # the two. Ring collectives over NVLink inside a node, over each device's NIC across nodes, at this
    # share of the nominal per-direction bandwidth: nccl-tests all_gather / reduce_scatter bus bandwidth
    # on HGX H100 is ~360 GB/s over NVLink (450 nominal).
    collective_bandwidth_efficiency: float = 0.8
    # The same share for the NICs a ring's cross-node hops go through (`CostModel.link`: one ring per rail, each
    # node's share of the traffic on the NICs of the group's devices there). Not fitted: nccl-tests' large-message
    # all_reduce bus bandwidth on H100 nodes with NDR InfiniBand, 400-450 GB/s across nodes (saturncloud.io,
    # "Validating Multi-Node GPU Clusters with NCCL Tests", expected-performance table), is at least 0.8 of the
    # 8 x 50 GB/s NICs of an 8-GPU node. It once was a fitted 0.2 of one NIC per ring (from [QI64] alone): a
    # DanceGRPO FSDP trainer over four nodes (calib-dancegrpo-flux-32xh800) all-gathers ~37 TB per device per
    # 291 s step, at least 127 GB/s, twelve times what that factor allowed; what [QI64] needs is its cluster's own
    # network (its scenario's network_gbps), not a property of every cross-node collective.
    network_collective_efficiency: float = 0.8
    # Bytes per parameter of the gradient reduce-scatter: verl's FSDP workers use
    # MixedPrecision(param_dtype=bf16, reduce_dtype=float32). fastvideo (DanceGRPO) defaults to fp32 for
    # both (master_weight_type="fp32"), i.e. heavier all-gathers; we charge every trainer verl's lighter figures.
    grad_reduce_bytes: int = 4

    # --- optimizer, offload, switches, weight publication --------------------------------------
    # AdamW step streams fp32 master weights, two moments and grads: bytes / (HBM bw x this).
    optimizer_bandwidth_efficiency: float = 0.5
    # Host<->device copies (param / optimizer offload, sleep / wake of the rollout engine) run at this share
    # of the device's host link (`Device.host_bandwidth`): 25 GB/s effective on PCIe Gen5 x16 (64 nominal) is
    # what verl logs show for wake_up; pageable host memory and bucketed copies keep it well below nominal.
    host_link_efficiency: float = 25 / 64
    # Fixed part of a rollout sleep / wake (allocator reset, CUDA-graph re-capture is skipped).
    switch_fixed_s: float = 1.0
    # Weight publication trainer -> rollout engines, each receiving a full bf16 replica through the
    # host (verl's default "naive" checkpoint engine, bucketed). [WAN]: weight update 6.8 s for the
    # 56 GB of both Wan2.2-A14B experts -> 56e9 / (64e9 x 25/64 x 0.36) + 0.5 s = 6.7 s.
    publish_bandwidth_efficiency: float = 0.36
    publish_fixed_s: float = 0.5

    # --- a run on CPU cores: the driver and Ray share the devices' cores -------------------------
    # A CPU run's devices are its cores, and its driver, raylet and GCS take their share of them (top during
    # benchmarks/dry_run_accuracy.py's run: the driver 6-13 %, raylet and GCS ~6 %, each worker 80-93 %); a start-up
    # profile, in the dry run's process or in the workers before the run's loop, has its core to itself. Fitted to
    # that benchmark's verl-sync run (2-core AMD EPYC container, Dec 6 2026): each node's own work (timed inside the
    # worker) took 1.14-1.20x its profiled seconds (train 222 ms against 185), and the driver saw each node 4-15 ms
    # (median 8) after the worker did: the call's submission, its answer through the object store, the driver's
    # decision. `CostModel.on_busy_cores` applies both; other policies' runs are the held-out check (BENCHMARKS).
    cpu_run_slowdown: float = 1.17
    cpu_node_call_s: float = 0.008

    # --- online correction -----------------------------------------------------------------------
    # Weight of one new measurement in the running measured/predicted ratio per op kind.
    correction_rate: float = 0.3

    # --- JigsawRL interference: slowdown of a sub-stage when co-located with another -------------
    # (kind running, kind alongside) -> multiplicative slowdown. Decode is bandwidth-bound and
    # training compute-bound, so they overlap well (JigsawRL, "complementary sub-stages"); two
    # compute-bound sub-stages contend almost fully.
    interference: dict[tuple[str, str], float] = field(
        default_factory=lambda: {
            ("decode", "decode"): 1.15,
            ("decode", "train"): 1.25,
            ("decode", "logprob"): 1.20,
            ("decode", "prefill"): 1.20,
            ("train", "decode"): 1.10,
            ("logprob", "decode"): 1.10,
            ("prefill", "decode"): 1.10,
            ("train", "train"): 1.90,
            ("train", "logprob"): 1.80,
            ("logprob", "train"): 1.80,
            ("logprob", "logprob"): 1.80,
        }
    )

    def slowdown(self, kind: str, alongside: str) -> float:
        """Slowdown of `kind` sharing its devices with `alongside`; 2.0 (time slicing) if unknown."""
        return self.interference.get((kind, alongside), 2.0)


DEFAULT = Calibration()
