//! The `pd` section of `proxy.yaml`: how a disaggregated request is carried
//! out once the scheduler chose a prefill pod and a decode pod (docs/pd.md).
//! Whether to disaggregate at all is the filter config's decision (the
//! `disagg-profile-handler` and its `prefix-based-pd-decider`).

use serde::{Deserialize, Serialize};

use super::Duration;

/// See the module docs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Pd {
    /// How prefill hands its KV cache to decode.
    pub connector: PdConnector,
    /// Deadline of the prefill leg (its whole response).
    pub prefill_timeout: Duration,
    /// Extra prefill attempts after a connect error or a retryable status
    /// (429, 502, 503, 504), on the next prefill pod when there is one.
    pub prefill_retries: u32,
    /// Pause before the first retry; doubles with each further one.
    pub retry_backoff: Duration,
    /// What to do when prefill fails for good: serve the request aggregated
    /// on the decode pod (`aggregated`), or fail it (`error`).
    pub on_prefill_failure: OnPrefillFailure,
    /// SGLang's prefill bootstrap port (`--disaggregation-bootstrap-port`).
    pub sglang_bootstrap_port: u16,
    /// The kvagent port on every node (`kvagent` connector).
    pub kvagent_port: u16,
    /// Serve requests carrying llm-d's `x-prefiller-host-port` as P/D with
    /// that prefiller and the local engine decoding.
    pub accept_prefiller_header: bool,
    /// If not empty, the only `host:port` values that header may name (SSRF guard).
    pub allowed_prefillers: Vec<String>,
    /// Disaggregate when the prompt part the chosen decode pod lacks has at
    /// least this many tokens: sets the filter config's P/D decider threshold
    /// (and turns on the built-in P/D filter config when the file has no decider).
    pub min_uncached_tokens: Option<u32>,
}

/// The P/D protocols the sidecar speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PdConnector {
    /// vLLM's `NixlConnector`: prefill with `do_remote_decode`, then decode
    /// with the `kv_transfer_params` prefill returned.
    #[default]
    Nixl,
    /// SGLang PD: one body to both, with `bootstrap_host/port/room`, concurrently.
    Sglang,
    /// Engines with the kvmesh connector: the node's kvagents move the blocks.
    Kvagent,
}

/// See [`Pd::on_prefill_failure`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnPrefillFailure {
    #[default]
    Aggregated,
    Error,
}

impl Default for Pd {
    fn default() -> Self {
        Self {
            connector: PdConnector::Nixl,
            prefill_timeout: Duration::from_secs(60),
            prefill_retries: 2,
            retry_backoff: Duration::from_millis(200),
            on_prefill_failure: OnPrefillFailure::Aggregated,
            sglang_bootstrap_port: 8998,
            kvagent_port: 7600,
            accept_prefiller_header: true,
            allowed_prefillers: Vec::new(),
            min_uncached_tokens: None,
        }
    }
}

impl Pd {
    /// Rules that span fields; `(field, message)` on the first broken one.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.prefill_retries > 10 {
            return Err((
                "pd.prefill_retries".to_owned(),
                format!(
                    "{} is more than 10: retries multiply load on a failing pool",
                    self.prefill_retries
                ),
            ));
        }
        if self.prefill_timeout.get().is_zero() {
            return Err((
                "pd.prefill_timeout".to_owned(),
                "must be more than 0".to_owned(),
            ));
        }
        if self.connector == PdConnector::Sglang && self.min_uncached_tokens.is_some_and(|n| n > 0)
        {
            // SGLang's decode servers (`--disaggregation-mode decode`) refuse a
            // request without bootstrap fields: nothing may be kept whole.
            return Err((
                "pd.min_uncached_tokens".to_owned(),
                "must be 0 with the sglang connector: an SGLang decode server serves only split \
                 requests, so every request is disaggregated (or use always-disagg-pd-decider in \
                 filters.yaml)"
                    .to_owned(),
            ));
        }
        for (i, p) in self.allowed_prefillers.iter().enumerate() {
            if p.rsplit_once(':')
                .and_then(|(_, port)| port.parse::<u16>().ok())
                .is_none()
            {
                return Err((
                    format!("pd.allowed_prefillers[{i}]"),
                    format!("{p:?} is not host:port"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn sglang_splits_every_request() {
        let p = |n| Pd {
            connector: PdConnector::Sglang,
            min_uncached_tokens: n,
            ..Pd::default()
        };
        assert!(p(None).validate().is_ok());
        assert!(p(Some(0)).validate().is_ok());
        let (field, why) = p(Some(2048)).validate().unwrap_err();
        assert_eq!(field, "pd.min_uncached_tokens");
        assert!(why.contains("only split"), "{why}");
        let nixl = Pd {
            min_uncached_tokens: Some(2048),
            ..Pd::default()
        };
        assert!(nixl.validate().is_ok());
    }
}
