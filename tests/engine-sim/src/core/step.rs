//! One scheduler step: planning (which sequences run, how many prompt tokens
//! each prefills, who is admitted) and finishing (advance, commit full blocks
//! to the prefix cache, sample tokens, retire finished requests).

use super::{Core, CoreEvent, FinishReason, Held, KvMode, Outcome, Resumed, Seq};
use crate::kv::cache::BlockRun;
use crate::kv::hash;
use crate::profile::StepLoad;

#[derive(Debug, Clone, Copy)]
enum Work {
    Prefill(usize),
    Decode,
}

/// What one step does and what it costs (virtual seconds).
#[derive(Debug)]
pub(super) struct Plan {
    pub cost: f64,
    items: Vec<(usize, Work)>,
    prefill_tokens: usize,
}

/// The context hash after `tokens` (see [`next_token`]).
pub(super) fn context_of(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0, |h, t| extend(h, *t))
}

/// The context hash with one more token.
fn extend(context: u64, token: u32) -> u64 {
    mix(context.rotate_left(7) ^ u64::from(token).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// The next output token after a context: a function of every token before
/// it and nothing else, as greedy decoding is. A request whose prompt is
/// another's prompt plus its first k output tokens (a migrated request, a
/// preempted one recomputed) goes on with that one's token k+1.
fn next_token(context: u64) -> u32 {
    16 + (mix(context ^ 0x5bd1_e995) % 2032) as u32
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Seq {
    fn token_at(&self, pos: usize) -> u32 {
        let p = self.req.prompt.len();
        if pos < p {
            self.req.prompt[pos]
        } else {
            self.output.get(pos - p).copied().unwrap_or(0)
        }
    }

    fn tokens(&self, from: usize, to: usize) -> Vec<u32> {
        (from..to).map(|i| self.token_at(i)).collect()
    }
}

impl Core {
    pub(super) fn plan_step(&mut self) -> Option<Plan> {
        let bs = self.cfg.block_size;
        self.preempt_if_needed();
        let mut budget = self.cfg.profile.max_num_batched_tokens;
        let mut items = Vec::new();
        let mut load = StepLoad::default();
        for i in 0..self.running.len() {
            if let Some(done) = self.running[i].transfer_done_v {
                if done > self.vnow {
                    continue;
                }
                self.running[i].transfer_done_v = None;
                self.commit_full(i);
            }
            let s = &mut self.running[i];
            let plen = s.req.prompt.len();
            if s.computed < plen {
                let chunk = (plen - s.computed).min(budget);
                if chunk > 0 {
                    budget -= chunk;
                    load = load.with_chunk(s.computed, chunk);
                    items.push((i, Work::Prefill(chunk)));
                }
            } else if budget > 0 {
                if (s.computed + 1).div_ceil(bs) > s.blocks.len() {
                    match self.pool.allocate(1) {
                        Some(b) => s.blocks.extend(b),
                        None => continue, // preemption freed what it could
                    }
                }
                budget -= 1;
                load.decode_seqs += 1;
                load.decode_ctx_tokens += s.computed;
                items.push((i, Work::Decode));
            }
        }
        while self.running.len() < self.cfg.max_num_seqs && budget > 0 {
            let Some(front) = self.waiting.front() else {
                break;
            };
            if front.ready_v > self.vnow {
                break;
            }
            let plen = front.req.prompt.len();
            // At least one prompt token is always computed (vLLM).
            let max_hit = ((plen.saturating_sub(1)) / bs).min(front.hashes.len());
            let hits = self.pool.match_prefix(&front.hashes[..max_hit]);
            let need = plen.div_ceil(bs).max(1) - hits.len();
            let hits_free = hits.iter().filter(|id| self.pool.is_free(**id)).count();
            if need > self.pool.num_free() - hits_free {
                break;
            }
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            self.pool.acquire(&hits);
            let Some(fresh) = self.pool.allocate(need) else {
                self.pool.release(&hits);
                self.waiting.push_front(s);
                break;
            };
            s.committed = hits.len();
            s.blocks = hits;
            s.blocks.extend(fresh);
            s.cached_tokens = s.committed * bs;
            s.computed = s.cached_tokens;
            s.scheduled_v.get_or_insert(self.vnow);
            {
                let mut m = self.metrics.lock();
                // vLLM counts a preempted request's lookup apart, so that a
                // victim hitting its own blocks again does not raise the hit
                // rate; its recompute shows there instead.
                if s.resumed.is_some() {
                    m.preempted_queries += plen as u64;
                    m.preempted_hits += s.cached_tokens as u64;
                } else {
                    m.prefix_queries += plen as u64;
                    m.prefix_hits += s.cached_tokens as u64;
                }
                if s.req.kv == KvMode::ReceiveKv {
                    m.external_queries += plen as u64;
                    m.external_hits += (plen - s.cached_tokens) as u64;
                }
            }
            if s.req.kv == KvMode::ReceiveKv {
                s.external_tokens = plen - s.cached_tokens;
                s.computed = plen;
                s.transfer_done_v =
                    Some(self.vnow + self.cfg.profile.transfer_seconds(s.external_tokens));
                self.running.push(s);
                continue;
            }
            let chunk = (plen - s.computed).min(budget);
            budget -= chunk;
            load = load.with_chunk(s.computed, chunk);
            items.push((self.running.len(), Work::Prefill(chunk)));
            self.running.push(s);
        }
        if items.is_empty() {
            return None;
        }
        let modelled = self.cfg.profile.step_seconds(&load);
        let cost = self.jitter.step_seconds(modelled);
        Some(Plan {
            cost,
            items,
            prefill_tokens: load.prefill_tokens,
        })
    }

    /// Frees blocks for this step's decodes by sending the newest running
    /// requests back to the waiting queue (vLLM's recompute preemption).
    fn preempt_if_needed(&mut self) {
        let bs = self.cfg.block_size;
        loop {
            let needed = self
                .running
                .iter()
                .filter(|s| s.transfer_done_v.is_none() && s.computed >= s.req.prompt.len())
                .filter(|s| (s.computed + 1).div_ceil(bs) > s.blocks.len())
                .count();
            if needed <= self.pool.num_free() || self.running.len() <= 1 {
                return;
            }
            let Some(mut s) = self.running.pop() else {
                return;
            };
            self.pool.release(&s.blocks);
            s.blocks.clear();
            s.committed = 0;
            s.computed = 0;
            let resumed = s.resumed.get_or_insert_with(|| Resumed {
                prompt_len: s.req.prompt.len(),
                output: Vec::new(),
                max_tokens: s.req.max_tokens,
                cached_tokens: s.cached_tokens,
            });
            resumed.output.extend_from_slice(&s.output);
            // Prompt and output are recomputed together; tokens already sent
            // stay sent, and the answer goes on from the next one.
            s.req.prompt.extend_from_slice(&s.output);
            s.req.max_tokens = s.req.max_tokens.saturating_sub(s.output.len()).max(1);
            s.output.clear();
            s.hashes = hash::block_hashes(&s.req.prompt, bs, &s.req.extras);
            self.metrics.lock().preemptions += 1;
            self.waiting.push_front(s);
        }
    }

    /// Commits every full block of running sequence `i` not yet in the cache.
    fn commit_full(&mut self, i: usize) {
        let bs = self.cfg.block_size;
        let s = &mut self.running[i];
        let full = (s.computed / bs).min(s.blocks.len());
        if s.hashes.len() < full {
            // Output tokens filled a block: vLLM's chain needs every parent
            // digest, so rehash the sequence (rare: once per block_size tokens).
            s.hashes = hash::block_hashes(&s.tokens(0, full * bs), bs, &s.req.extras);
        }
        if full <= s.committed {
            return;
        }
        let from = s.committed;
        let parent = from.checked_sub(1).and_then(|p| s.hashes.get(p).copied());
        let toks = s.tokens(from * bs, full * bs);
        self.pool.commit(BlockRun {
            ids: &s.blocks[from..full],
            hashes: &s.hashes[from..full],
            parent,
            tokens: &toks,
            lora_name: s.req.extras.lora_name.as_deref(),
            salt: s.req.extras.cache_salt.as_deref(),
            first_index: from,
        });
        s.committed = full;
    }

    pub(super) fn finish_step(&mut self, plan: Plan) {
        let now = self.vnow;
        let mut done = vec![false; self.running.len()];
        let mut gen_tokens = 0u64;
        let mut itls = Vec::new();
        for &(i, work) in &plan.items {
            match work {
                Work::Prefill(n) => self.running[i].computed += n,
                Work::Decode => self.running[i].computed += 1,
            }
            self.commit_full(i);
            let s = &mut self.running[i];
            if s.computed < s.req.prompt.len() {
                continue; // a chunk of a longer prefill
            }
            let tok = next_token(s.context);
            s.context = extend(s.context, tok);
            s.output.push(tok);
            gen_tokens += 1;
            match s.first_token_v {
                None => s.first_token_v = Some(now),
                Some(_) => itls.push(now - s.last_token_v),
            }
            s.last_token_v = now;
            let last = s.output.len() >= s.req.max_tokens;
            if s.req.stream && s.req.out.send(CoreEvent::Token { id: tok, last }).is_err() {
                done[i] = true; // client went away: abort
                continue;
            }
            if last || s.req.out.is_closed() {
                done[i] = true;
            }
        }
        {
            let mut m = self.metrics.lock();
            m.generation_tokens += gen_tokens;
            m.iteration_tokens
                .observe((plan.prefill_tokens as u64 + gen_tokens) as f64);
            for itl in itls {
                m.itl.observe(itl);
            }
        }
        let mut idx = 0;
        let finished: Vec<Seq> = {
            let mut out = Vec::new();
            let mut keep = Vec::with_capacity(self.running.len());
            for s in self.running.drain(..) {
                if done.get(idx).copied().unwrap_or(false) {
                    out.push(s);
                } else {
                    keep.push(s);
                }
                idx += 1;
            }
            self.running = keep;
            out
        };
        for s in finished {
            self.retire(s);
        }
        self.publish();
        self.update_gauges();
    }

    fn retire(&mut self, mut s: Seq) {
        let now = self.vnow;
        let aborted = s.req.out.is_closed();
        let reason = if s.output.len() >= s.req.max_tokens {
            s.req.limit_reason
        } else {
            FinishReason::Stop
        };
        let first = s.first_token_v.unwrap_or(now);
        let sched = s.scheduled_v.unwrap_or(now);
        // A preempted request is reported as its client sent it.
        let plen = match s.resumed.take() {
            Some(mut r) => {
                r.output.append(&mut s.output);
                s.output = r.output;
                s.req.max_tokens = r.max_tokens;
                s.cached_tokens = r.cached_tokens;
                r.prompt_len
            }
            None => s.req.prompt.len(),
        };
        let mut held_blocks = None;
        match (&s.req.kv, reason, aborted) {
            (KvMode::HoldForDecode { remote_request_id }, FinishReason::Length, false) => {
                let expiry_v = now + self.cfg.pd_hold_timeout_s;
                let real_ttl = self.clock.real_duration(self.cfg.pd_hold_timeout_s);
                crate::pd::register(
                    &self.engine_id,
                    remote_request_id,
                    crate::pd::Registered {
                        release: self.self_tx.clone(),
                        prompt_tokens: plen,
                        expires: std::time::Instant::now() + real_ttl,
                    },
                );
                self.held.insert(
                    remote_request_id.clone(),
                    Held {
                        blocks: s.blocks.clone(),
                        expiry_v,
                    },
                );
                held_blocks = Some(s.blocks.clone());
            }
            _ => self.pool.release(&s.blocks),
        }
        {
            let mut m = self.metrics.lock();
            let label = if aborted { "abort" } else { reason.as_str() };
            m.finished(label);
            m.prompt_tokens += plen as u64;
            m.by_source_compute += (plen - s.cached_tokens - s.external_tokens) as u64;
            m.by_source_cache += s.cached_tokens as u64;
            m.by_source_external += s.external_tokens as u64;
            m.ttft.observe(first - s.arrival_v);
            m.e2e.observe(now - s.arrival_v);
            m.queue_time.observe(sched - s.arrival_v);
            m.prefill_time.observe(first - sched);
            m.decode_time.observe(now - first);
            m.inference_time.observe(now - sched);
            if s.output.len() > 1 {
                m.tpot.observe((now - first) / (s.output.len() - 1) as f64);
            }
            m.request_prompt_tokens.observe(plen as f64);
            m.request_generation_tokens.observe(s.output.len() as f64);
            m.request_max_tokens.observe(s.req.max_tokens as f64);
        }
        if aborted {
            return;
        }
        let outcome = Outcome {
            prompt_tokens: plen,
            output: s.output,
            finish_reason: reason,
            cached_tokens: s.cached_tokens,
            external_tokens: s.external_tokens,
            queue_s: sched - s.arrival_v,
            ttft_s: first - s.arrival_v,
            e2e_s: now - s.arrival_v,
            held_blocks,
        };
        let _ = s.req.out.send(CoreEvent::Finished(Box::new(outcome)));
    }
}
