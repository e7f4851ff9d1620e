"""Lab 8 (memory beyond sharding: loss scaling, mixed precision, ZeRO-1, recomputation): realistic
wrong implementations, and correct alternatives to the solution that must get full marks.

Each bug edits one solution cell of solutions/lab8_memory/lab8_memory.ipynb and names the test
cells that must lose points; each alternative rewrites one solution cell correctly (format:
solutions/BUGBANK.md).

The steps are handed the checks' own loss scaler (the notebook's contract), so a wrong scaler
costs the scaler's test only. Several bugs give the right numbers in the visible cases and are
caught by a hidden one: an overflow seen by one rank only (or in one rank's shard), more steps,
a group of three. Some are caught by the bytes a rank holds (gradients left after the step) or by
the bytes saved for backward (selective recomputation that keeps too much or too little).
"""

SCALER = "test_DynamicLossScaler"
MIXED = "test_mixed_precision_step"
ZERO1 = "test_zero1_mixed_precision_step"
RECOMPUTE = "test_recompute_blocks"

BUGS = [
    # ------------------------------------------------------------------ DynamicLossScaler
    dict(
        name="scaler_overflow_not_agreed",
        cell="DynamicLossScaler",
        replace=[("        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)      # one rank's overflow is "
                  "everyone's\n", "")],
        catches=[SCALER],
        why="found_inf is each rank's own: a rank without the inf steps while the others skip",
    ),
    dict(
        name="scaler_agrees_over_the_world",
        cell="DynamicLossScaler",
        replace=[("op=dist.ReduceOp.MAX, group=self.group)", "op=dist.ReduceOp.MAX)")],
        catches=[SCALER],
        why="the flag is all-reduced over every rank, not the scaler's group: one group's overflow skips the others",
    ),
    dict(
        name="scaler_agrees_with_min",
        cell="DynamicLossScaler",
        replace=[("op=dist.ReduceOp.MAX", "op=dist.ReduceOp.MIN")],
        catches=[SCALER],
        why="the flags are all-reduced with MIN: an overflow counts only when every rank has one",
    ),
    dict(
        name="scaler_multiplies_instead_of_dividing",
        cell="DynamicLossScaler",
        replace=[("p.grad.mul_(1.0 / self.loss_scale)", "p.grad.mul_(self.loss_scale)")],
        catches=[SCALER],
        why="unscale_ multiplies the gradients by the scale again",
    ),
    dict(
        name="scaler_unscale_not_in_place",
        cell="DynamicLossScaler",
        replace=[("                p.grad.mul_(1.0 / self.loss_scale)\n",
                  "                p.grad = p.grad / self.loss_scale\n")],
        catches=[SCALER],
        why="unscale_ puts new tensors in .grad: an optimizer or a caller holding the gradients sees them scaled",
    ),
    dict(
        name="scaler_count_kept_after_overflow",
        cell="DynamicLossScaler",
        replace=[("            self.loss_scale *= self.backoff_factor\n            self.good_steps = 0\n",
                  "            self.loss_scale *= self.backoff_factor\n")],
        catches=[SCALER],
        why="an overflow does not restart the count of good steps: the scale grows back too early",
    ),
    dict(
        name="scaler_count_kept_after_growth",
        cell="DynamicLossScaler",
        replace=[("                self.loss_scale *= self.growth_factor\n                self.good_steps = 0",
                  "                self.loss_scale *= self.growth_factor")],
        catches=[SCALER],
        why="the count is not restarted after growing: the scale grows once and then never again",
    ),
    dict(
        name="scaler_scale_detached",
        cell="DynamicLossScaler",
        replace=[("        return loss * self.loss_scale\n", "        return loss.detach() * self.loss_scale\n")],
        catches=[SCALER],
        why="scale(loss) detaches the loss: backward cannot go through it",
    ),
    dict(
        name="scaler_no_argument_checks",
        cell="DynamicLossScaler",
        replace=[("        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):\n"
                  "            raise ValueError(\"need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                  "growth_interval >= 1\")\n", "")],
        catches=[SCALER],
        why="no ValueError for a zero scale, a growth factor of 1 or a backoff above 1",
    ),

    # ------------------------------------------------------------------ mixed_precision_step
    dict(
        name="mixed_sum_not_mean",
        cell="mixed_precision_step",
        replace=[("    flat /= dist.get_world_size(group)\n", "")],
        catches=[MIXED],
        why="the gradients are summed over the group, not averaged",
    ),
    dict(
        name="mixed_never_unscales",
        cell="mixed_precision_step",
        replace=[("    found_inf = scaler.unscale_(master_params) if scaler is not None else False\n",
                  "    found_inf = False\n")],
        catches=[MIXED],
        why="the scaled gradients are stepped as they are: updates S times too large, overflows never skipped",
    ),
    dict(
        name="mixed_steps_through_overflow",
        cell="mixed_precision_step",
        replace=[("    if not found_inf:\n        optimizer.step()\n", "    optimizer.step()\n")],
        catches=[MIXED],
        why="the optimizer steps even when a gradient overflowed: inf/NaN reach the masters and Adam's moments",
    ),
    dict(
        name="mixed_no_copy_back",
        cell="mixed_precision_step",
        replace=[("            p.copy_(m)                                  # rounds to the model's 16-bit dtype\n", "")],
        catches=[MIXED],
        why="the masters are updated but never copied back: the 16-bit model keeps its first weights",
    ),
    dict(
        name="mixed_model_grads_kept",
        cell="mixed_precision_step",
        replace=[("            p.grad = m.grad = None\n", "            m.grad = None\n")],
        catches=[MIXED],
        why="the model's 16-bit gradients are not freed: the next backward adds to them (and 2 bytes stay held)",
    ),
    dict(
        name="mixed_update_twice",
        cell="mixed_precision_step",
        replace=[("    if scaler is not None:\n        scaler.update(found_inf)\n",
                  "    if scaler is not None:\n        scaler.update(found_inf)\n        scaler.update(found_inf)\n")],
        catches=[MIXED],
        why="the scale is updated twice per step: it grows (and backs off) twice as fast",
    ),
    dict(
        name="mixed_no_fit_check",
        cell="mixed_precision_step",
        replace=[("    if len(params) != len(master_params) or any(m.shape != p.shape or m.dtype != torch.float32\n"
                  "                                                  for p, m in zip(params, master_params)):\n"
                  "        raise ValueError(\"master_params must be one fp32 tensor per model parameter, same shapes, "
                  "same order\")\n", "")],
        catches=[MIXED],
        why="no ValueError when a master is missing: zip() drops a parameter silently",
    ),

    # ------------------------------------------------------------------ zero1_mixed_precision_step
    dict(
        name="zero1_overflow_seen_by_owner_only",
        cell="zero1_mixed_precision_step",
        replace=[("    found_inf = scaler.unscale_([master_shard]) if scaler is not None else False\n",
                  "    found_inf = False\n"
                  "    if scaler is not None:                        # unscale my shard and look at it myself\n"
                  "        master_shard.grad.mul_(1.0 / scaler.loss_scale)\n"
                  "        found_inf = not bool(torch.isfinite(master_shard.grad).all())\n")],
        catches=[ZERO1],
        why="the overflow check looks at this rank's shard only: an inf in another shard is stepped past here",
    ),
    dict(
        name="zero1_first_chunk_for_everyone",
        cell="zero1_mixed_precision_step",
        replace=[("master_shard.grad = flat[start:end] / world", "master_shard.grad = flat[:end - start] / world")],
        catches=[ZERO1],
        why="every rank takes the first chunk of the averaged gradient, not its own",
    ),
    dict(
        name="zero1_sum_not_mean",
        cell="zero1_mixed_precision_step",
        replace=[("master_shard.grad = flat[start:end] / world", "master_shard.grad = flat[start:end].clone()")],
        catches=[ZERO1],
        why="the shard's gradient is the sum over the group, not the mean",
    ),
    dict(
        name="zero1_model_grads_kept",
        cell="zero1_mixed_precision_step",
        replace=[("            p.copy_(new.view_as(p))\n            p.grad = None\n", "            p.copy_(new.view_as(p))\n")],
        catches=[ZERO1],
        why="the model's 16-bit gradients are not freed: the next backward adds to them",
    ),
    dict(
        name="zero1_unpadded_all_gather",
        cell="zero1_mixed_precision_step",
        replace=[("    mine = torch.zeros(size, dtype=params[0].dtype, device=master_shard.device)\n"
                  "    mine[:end - start] = master_shard.detach()                       # 16-bit, padded\n",
                  "    mine = master_shard.detach().to(params[0].dtype)\n")],
        catches=[ZERO1],
        why="unequal shards all-gathered without padding: the sizes differ between ranks and the gather fails",
    ),
    dict(
        name="zero1_own_shard_only",
        cell="zero1_mixed_precision_step",
        replace=[("    dist.all_gather(pieces, mine, group=group)\n    full = torch.cat(pieces)[:numel]\n",
                  "    full = torch.cat([q.detach().flatten() for q in params])      # the others' shards: as they were\n"
                  "    full[start:end] = master_shard.detach()\n")],
        catches=[ZERO1],
        why="no all-gather: each rank refreshes its own shard of the model and keeps the others' old weights",
    ),
    dict(
        name="scaler_flag_without_device",
        cell="DynamicLossScaler",
        replace=[("        bad = torch.zeros(1, device=minidist.device())\n", "        bad = torch.zeros(1)\n")],
        catches=["test_memory_device"],
        why="the overflow flag is made without device=: right on CPU ranks, a CPU tensor for NCCL's all-reduce on "
            "a GPU node (only the device check sees it)",
    ),

    # ------------------------------------------------------------------ recompute_blocks
    dict(
        name="recompute_rng_not_replayed",
        cell="recompute_blocks",
        replace=[("        set_rng_state(ctx.rng)                     # the same dropout masks as in forward\n", "")],
        catches=[RECOMPUTE],
        why="the recomputation draws new dropout masks: the gradient belongs to another forward",
    ),
    dict(
        name="recompute_rng_not_restored",
        cell="recompute_blocks",
        replace=[("        set_rng_state(now)                         # and the generator where forward left it\n", "")],
        catches=[RECOMPUTE],
        why="the random state is left where the replay ended: later dropout draws differ from a run without recomputation",
    ),
    dict(
        name="recompute_selective_keeps_scores",
        cell="recompute_blocks",
        replace=[("    y = Recompute.apply(core, heads(attn.q(h)), heads(attn.k(h)), heads(attn.v(h)))\n",
                  "    y = core(heads(attn.q(h)), heads(attn.k(h)), heads(attn.v(h)))\n")],
        catches=[RECOMPUTE],
        why="selective runs attention's core plainly: the scores and softmax are kept, nothing is saved",
    ),
    dict(
        name="recompute_selective_from_block_input",
        cell="recompute_blocks",
        replace=[("    y = Recompute.apply(core, heads(attn.q(h)), heads(attn.k(h)), heads(attn.v(h)))\n",
                  "    y = Recompute.apply(lambda h: core(heads(attn.q(h)), heads(attn.k(h)), heads(attn.v(h))), h)\n")],
        catches=[RECOMPUTE],
        why="selective recomputes the q/k/v projections too: less is kept than the formula says, at more FLOPs",
    ),
    dict(
        name="recompute_full_detaches_input",
        cell="recompute_blocks",
        replace=[("            x = Recompute.apply(block, x)\n", "            x = Recompute.apply(block, x.detach())\n")],
        catches=[RECOMPUTE],
        why="the block's input is detached: no gradient flows to x or to the blocks before",
    ),
    dict(
        name="recompute_unknown_policy_accepted",
        cell="recompute_blocks",
        replace=[("    if policy not in (\"none\", \"full\", \"selective\"):\n"
                  "        raise ValueError(f\"policy must be 'none', 'full' or 'selective', got {policy!r}\")\n", "")],
        catches=[RECOMPUTE],
        why="an unknown policy silently runs as selective",
    ),
]

ALTERNATIVES = [
    # ------------------------------------------------------------------ DynamicLossScaler
    dict(
        name="scaler_sum_of_counts",
        cell="DynamicLossScaler",
        replace=[("        bad = torch.zeros(1, device=minidist.device())\n"
                  "        for p in params:\n"
                  "            if p.grad is not None:\n"
                  "                p.grad.mul_(1.0 / self.loss_scale)\n"
                  "                bad = torch.maximum(bad, (~torch.isfinite(p.grad)).any().to(bad.device, bad.dtype))\n"
                  "        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)      # one rank's overflow is "
                  "everyone's\n"
                  "        return bool(bad.item())\n",
                  "        count = 0\n"
                  "        for p in params:\n"
                  "            if p.grad is not None:\n"
                  "                count += int(p.grad.isinf().sum() + p.grad.isnan().sum())\n"
                  "                p.grad.div_(self.loss_scale)\n"
                  "        total = torch.tensor([count], dtype=torch.int64, device=minidist.device())\n"
                  "        dist.all_reduce(total, group=self.group)                # SUM of every rank's count\n"
                  "        return total.item() > 0\n")],
        why="counts the non-finite values before dividing, all-reduces the counts with SUM",
    ),
    dict(
        name="scaler_countdown",
        cell="DynamicLossScaler",
        replace=[("        self.growth_interval, self.group = int(growth_interval), group\n        self.good_steps = 0\n",
                  "        self.growth_interval, self.group = int(growth_interval), group\n"
                  "        self.until_growth = self.growth_interval\n"),
                 ("        if found_inf:\n"
                  "            self.loss_scale *= self.backoff_factor\n"
                  "            self.good_steps = 0\n"
                  "        else:\n"
                  "            self.good_steps += 1\n"
                  "            if self.good_steps == self.growth_interval:\n"
                  "                self.loss_scale *= self.growth_factor\n"
                  "                self.good_steps = 0",
                  "        self.until_growth = self.growth_interval if found_inf else self.until_growth - 1\n"
                  "        if found_inf:\n"
                  "            self.loss_scale = self.loss_scale * self.backoff_factor\n"
                  "        elif self.until_growth == 0:\n"
                  "            self.loss_scale, self.until_growth = self.loss_scale * self.growth_factor, self.growth_interval")],
        why="counts down the clean steps left before growing instead of counting them up",
    ),

    # ------------------------------------------------------------------ mixed_precision_step
    dict(
        name="mixed_per_tensor_all_reduce",
        cell="mixed_precision_step",
        replace=[("    flat = torch.cat([p.grad.flatten().float() for p in params])          # one all-reduce for the "
                  "whole model\n"
                  "    dist.all_reduce(flat, group=group)\n"
                  "    flat /= dist.get_world_size(group)\n"
                  "    for m, g in zip(master_params, flat.split([m.numel() for m in master_params])):\n"
                  "        m.grad = g.view_as(m)\n",
                  "    for p, m in zip(params, master_params):\n"
                  "        m.grad = p.grad.to(torch.float32)\n"
                  "        dist.all_reduce(m.grad, group=group)\n"
                  "        m.grad.div_(dist.get_world_size(group))\n")],
        why="one fp32 all-reduce per tensor instead of one of the flattened gradients",
    ),
    dict(
        name="mixed_copy_back_through_data",
        cell="mixed_precision_step",
        replace=[("    with torch.no_grad():\n"
                  "        for p, m in zip(params, master_params):\n"
                  "            p.copy_(m)                                  # rounds to the model's 16-bit dtype\n"
                  "            p.grad = m.grad = None\n",
                  "    for p, m in zip(params, master_params):\n"
                  "        p.data = m.detach().to(p.dtype)                 # a new 16-bit storage, the old one freed\n"
                  "        p.grad, m.grad = None, None\n")],
        why="copies back by giving each parameter a new 16-bit tensor (p.data =) instead of copying in place",
    ),

    # ------------------------------------------------------------------ zero1_mixed_precision_step
    dict(
        name="zero1_broadcast_unequal_shards",
        cell="zero1_mixed_precision_step",
        replace=[("    mine = torch.zeros(size, dtype=params[0].dtype, device=master_shard.device)\n"
                  "    mine[:end - start] = master_shard.detach()                       # 16-bit, padded\n"
                  "    pieces = [torch.empty_like(mine) for _ in range(world)]\n"
                  "    dist.all_gather(pieces, mine, group=group)\n"
                  "    full = torch.cat(pieces)[:numel]\n",
                  "    pieces = []\n"
                  "    for j in range(world):                          # each rank's shard, from that rank, unpadded\n"
                  "        s, e = shard_bounds(numel, j, world)\n"
                  "        piece = master_shard.detach().to(params[0].dtype) if j == rank else torch.empty(\n"
                  "            e - s, dtype=params[0].dtype, device=master_shard.device)\n"
                  "        dist.broadcast(piece, src=j if group is None else dist.get_global_rank(group, j), group=group)\n"
                  "        pieces.append(piece)\n"
                  "    full = torch.cat(pieces)\n")],
        why="each rank broadcasts its own (unpadded) shard in turn instead of one padded all-gather",
    ),
    dict(
        name="zero1_per_tensor_all_reduce",
        cell="zero1_mixed_precision_step",
        replace=[("    size = -(-numel // world)                                        # every shard padded to this\n"
                  "    flat = torch.zeros(size * world, dtype=torch.float32, device=master_shard.device)\n"
                  "    flat[:numel] = torch.cat([p.grad.flatten().float() for p in params])\n"
                  "    dist.all_reduce(flat, group=group)\n"
                  "    master_shard.grad = flat[start:end] / world                      # a copy: the full buffer can go\n"
                  "    del flat\n",
                  "    size = -(-numel // world)\n"
                  "    parts = []\n"
                  "    for p in params:                                # fp32 all-reduce tensor by tensor\n"
                  "        g = p.grad.float()\n"
                  "        dist.all_reduce(g, group=group)\n"
                  "        parts.append(g.flatten())\n"
                  "    master_shard.grad = torch.cat(parts)[start:end].div(world)\n"
                  "    del parts\n")],
        why="all-reduces each parameter's fp32 gradient separately and keeps its slice of their concatenation",
    ),

    # ------------------------------------------------------------------ recompute_blocks
    dict(
        name="recompute_torch_checkpoint",
        cell="recompute_blocks",
        replace=[("            x = Recompute.apply(block, x)\n",
                  "            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)\n"),
                 ("    y = Recompute.apply(core, heads(attn.q(h)), heads(attn.k(h)), heads(attn.v(h)))\n",
                  "    y = torch.utils.checkpoint.checkpoint(core, heads(attn.q(h)), heads(attn.k(h)), heads(attn.v(h)),\n"
                  "                                          use_reentrant=False)\n")],
        why="torch.utils.checkpoint (non-reentrant, random state preserved) instead of the lab's Recompute",
    ),
    dict(
        name="recompute_reentrant_checkpoint",
        cell="recompute_blocks",
        replace=[("            x = Recompute.apply(block, x)\n",
                  "            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)\n"),
                 ("    y = Recompute.apply(core, heads(attn.q(h)), heads(attn.k(h)), heads(attn.v(h)))\n",
                  "    y = torch.utils.checkpoint.checkpoint(core, heads(attn.q(h)), heads(attn.k(h)), heads(attn.v(h)),\n"
                  "                                          use_reentrant=True)\n")],
        why="torch.utils.checkpoint's reentrant form (an autograd.Function like the lab's)",
    ),
    dict(
        name="recompute_fork_rng",
        cell="recompute_blocks",
        replace=[("        now = get_rng_state(*inputs)\n"
                  "        set_rng_state(ctx.rng)                     # the same dropout masks as in forward\n"
                  "        with torch.enable_grad():\n"
                  "            out = ctx.fn(*inputs)\n"
                  "        set_rng_state(now)                         # and the generator where forward left it\n",
                  "        with torch.random.fork_rng(devices=ctx.rng[1][0]):     # puts every generator back on exit\n"
                  "            set_rng_state(ctx.rng)\n"
                  "            with torch.enable_grad():\n"
                  "                out = ctx.fn(*inputs)\n")],
        why="torch.random.fork_rng restores the generators after the replay instead of saving and setting them by hand",
    ),
]
