//! mmctl's HTTP client for agent APIs: bearer token on every call, JSON in
//! and out, and errors reduced to one line an operator can act on.

use std::path::Path;
use std::time::Duration;

use mm_proto::api::ErrorBody;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Default per-call timeout; add-node passes its own (it waits for a join).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the agent at {url}: {detail}")]
    Unreachable { url: String, detail: String },
    /// The agent answered with an error; `message` is its `{"error": ...}`.
    #[error("{message} (HTTP {status} from {url})")]
    Http {
        url: String,
        status: u16,
        message: String,
    },
    #[error("unexpected answer from {url}: {detail}")]
    Decode { url: String, detail: String },
}

/// Reads the cluster token: the file's content without surrounding whitespace.
pub fn read_token(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read token file {}: {e}", path.display()))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(format!("token file {} is empty", path.display()));
    }
    Ok(token.to_owned())
}

#[derive(Clone)]
pub struct AgentClient {
    http: reqwest::Client,
    token: String,
}

impl AgentClient {
    pub fn new(token: String) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(3))
            .build()
            .map_err(|e| format!("cannot set up the HTTP client: {e}"))?;
        Ok(Self { http, token })
    }

    pub async fn get<T: DeserializeOwned>(&self, base: &str, path: &str) -> Result<T, ClientError> {
        let url = join_url(base, path);
        let req = self.http.get(&url).timeout(DEFAULT_TIMEOUT);
        self.send(url, req).await
    }

    /// POSTs `body`; `timeout` None waits as long as the agent takes.
    pub async fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        base: &str,
        path: &str,
        body: &B,
        timeout: Option<Duration>,
    ) -> Result<T, ClientError> {
        let url = join_url(base, path);
        let mut req = self.http.post(&url).json(body);
        if let Some(t) = timeout {
            req = req.timeout(t);
        }
        self.send(url, req).await
    }

    async fn send<T: DeserializeOwned>(
        &self,
        url: String,
        req: reqwest::RequestBuilder,
    ) -> Result<T, ClientError> {
        let unreachable = |e: reqwest::Error, url: &str| ClientError::Unreachable {
            url: url.to_owned(),
            detail: describe(&e),
        };
        let resp = req
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|e| unreachable(e, &url))?;
        let status = resp.status();
        let body = resp.bytes().await.map_err(|e| unreachable(e, &url))?;
        if !status.is_success() {
            let message = serde_json::from_slice::<ErrorBody>(&body)
                .map(|b| b.error)
                .unwrap_or_else(|_| {
                    let text: String = String::from_utf8_lossy(&body).chars().take(200).collect();
                    if text.trim().is_empty() {
                        status.canonical_reason().unwrap_or("error").to_owned()
                    } else {
                        text
                    }
                });
            return Err(ClientError::Http {
                url,
                status: status.as_u16(),
                message: one_line(&message),
            });
        }
        serde_json::from_slice(&body).map_err(|e| ClientError::Decode {
            url,
            detail: e.to_string(),
        })
    }
}

fn join_url(base: &str, path: &str) -> String {
    format!("{}{path}", base.trim_end_matches('/'))
}

/// The innermost cause, on one line (see `join::describe_reqwest`).
fn describe(e: &reqwest::Error) -> String {
    one_line(&crate::join::describe_reqwest(e))
}

pub fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}
