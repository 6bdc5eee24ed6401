#!/usr/bin/env bash
# Install grpo_parts with everything its test suite needs, on CPU, into the current Python.
# torch first, from the CPU wheel, so nothing pulls a CUDA build.
set -euo pipefail
PIP="python -m pip"
$PIP install -q --upgrade pip
$PIP install -q torch==2.13.0
# transformers 5.10.x is the version verl 0.9.1, OpenRLHF 0.11.2 (at our seams) and TRL 1.16 all accept.
# [trackers]: the four experiment trackers of --report-to (tests/train/lifecycle/test_trackers.py reads each back offline)
$PIP install -q -e ".[dev,trl,verl,data,trackers]" "transformers>=5.10,<5.11"
# verl 0.9.1 pins a CUDA stack; its CPU seams (DataProto, core_algos) need only what [verl] lists.
$PIP install -q --no-deps verl==0.9.1
# verl v1 trainer seam (grpo_parts_sync) imports TransferQueue, whose deps pull ray[default]: --no-deps.
$PIP install -q --no-deps "TransferQueue>=0.1.10"
$PIP install -q "tensordict>=0.8,<=0.10.0,!=0.9.0"
# OpenRLHF 0.11.2 pins transformers==5.15, ray==2.55, flash-attn and a CUDA stack: --no-deps, plus what
# its CPU seams import ([openrlhf]: deepspeed built without ops, peft, aiohttp, einops, torchdata, datasets). ~25 s.
DS_BUILD_OPS=0 $PIP install -q -e ".[openrlhf]" "transformers>=5.10,<5.11"
$PIP install -q --no-deps openrlhf==0.11.2
