//! Raft RPC over the agent's HTTP API: JSON bodies, `Authorization: Bearer
//! <cluster token>` on every request. Both ends live here so the wire format
//! is defined in one place: a request is the openraft request type as JSON,
//! a response is `Result<response, RaftError>` as JSON (so a remote Raft error
//! reaches openraft as a `RemoteError`, not as a transport failure).

use std::sync::Arc;
use std::time::Duration;

use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Timeout, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, RPCTypes, Raft};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::types::TypeConfig;

pub const PATH_APPEND: &str = "/raft/append";
pub const PATH_VOTE: &str = "/raft/vote";
pub const PATH_SNAPSHOT: &str = "/raft/snapshot";

/// Which Raft RPC an inbound request carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RpcKind {
    Append,
    Vote,
    Snapshot,
}

/// A transport failure, with the URL (never the token) for the log line.
#[derive(Debug, thiserror::Error)]
enum TransportError {
    #[error("POST {url}: {source}")]
    Send {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url} answered HTTP {status}: {body}")]
    Status {
        url: String,
        status: u16,
        body: String,
    },
    #[error("undecodable response from {url}: {source}")]
    Decode {
        url: String,
        #[source]
        source: serde_json::Error,
    },
}

/// An inbound RPC that could not be handled; the API maps it to a status code.
#[derive(Debug, thiserror::Error)]
pub enum RpcServeError {
    #[error("malformed Raft RPC body: {0}")]
    BadRequest(serde_json::Error),
    #[error("cannot encode Raft RPC response: {0}")]
    Encode(serde_json::Error),
}

pub struct NetworkFactory {
    client: reqwest::Client,
    token: Arc<str>,
    self_id: u64,
}

impl NetworkFactory {
    pub(super) fn new(client: reqwest::Client, token: Arc<str>, self_id: u64) -> Self {
        Self {
            client,
            token,
            self_id,
        }
    }
}

impl RaftNetworkFactory<TypeConfig> for NetworkFactory {
    type Network = Network;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> Network {
        Network {
            client: self.client.clone(),
            token: Arc::clone(&self.token),
            self_id: self.self_id,
            target,
            node: node.clone(),
        }
    }
}

pub struct Network {
    client: reqwest::Client,
    token: Arc<str>,
    self_id: u64,
    target: u64,
    node: BasicNode,
}

impl Network {
    async fn post<Req, Resp, E>(
        &self,
        path: &str,
        kind: RPCTypes,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<u64, BasicNode, E>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let url = format!("{}{path}", self.node.addr.trim_end_matches('/'));
        let ttl = option.hard_ttl();
        let timeout_err = || {
            RPCError::Timeout(Timeout {
                action: kind,
                id: self.self_id,
                target: self.target,
                timeout: ttl,
            })
        };
        let sent = self
            .client
            .post(&url)
            .bearer_auth(&*self.token)
            .timeout(ttl)
            .json(req)
            .send()
            .await;
        let resp = match sent {
            Ok(r) => r,
            Err(e) if e.is_timeout() => return Err(timeout_err()),
            // Connection refused, DNS, TLS: the peer is down or unreachable;
            // openraft backs off before retrying.
            Err(source) => {
                return Err(RPCError::Unreachable(Unreachable::new(
                    &TransportError::Send { url, source },
                )));
            }
        };
        let status = resp.status();
        let body = match resp.bytes().await {
            Ok(b) => b,
            Err(e) if e.is_timeout() => return Err(timeout_err()),
            Err(source) => {
                return Err(RPCError::Network(NetworkError::new(
                    &TransportError::Send { url, source },
                )));
            }
        };
        if !status.is_success() {
            // 401 (token mismatch), 503 (peer starting or shutting down), 404
            // (not an mm agent): retrying at once won't help, so back off.
            let text = String::from_utf8_lossy(&body).chars().take(200).collect();
            return Err(RPCError::Unreachable(Unreachable::new(
                &TransportError::Status {
                    url,
                    status: status.as_u16(),
                    body: text,
                },
            )));
        }
        let result: Result<Resp, E> = serde_json::from_slice(&body).map_err(|source| {
            RPCError::Network(NetworkError::new(&TransportError::Decode {
                url: url.clone(),
                source,
            }))
        })?;
        result.map_err(|e| {
            RPCError::RemoteError(RemoteError::new_with_node(
                self.target,
                self.node.clone(),
                e,
            ))
        })
    }
}

impl RaftNetwork<TypeConfig> for Network {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        self.post(PATH_APPEND, RPCTypes::AppendEntries, &rpc, &option)
            .await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<u64>,
        RPCError<u64, BasicNode, RaftError<u64, InstallSnapshotError>>,
    > {
        self.post(PATH_SNAPSHOT, RPCTypes::InstallSnapshot, &rpc, &option)
            .await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<u64>,
        option: RPCOption,
    ) -> Result<VoteResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        self.post(PATH_VOTE, RPCTypes::Vote, &rpc, &option).await
    }

    fn backoff(&self) -> openraft::network::Backoff {
        // A down peer is retried every 500 ms: quick recovery on a LAN, little
        // noise while it stays down.
        openraft::network::Backoff::new(std::iter::repeat(Duration::from_millis(500)))
    }
}

/// Handles one inbound RPC: decodes the body, hands it to the local Raft,
/// encodes `Result<response, RaftError>`.
pub(super) async fn serve_rpc(
    raft: &Raft<TypeConfig>,
    kind: RpcKind,
    body: &[u8],
) -> Result<Vec<u8>, RpcServeError> {
    match kind {
        RpcKind::Append => {
            let req: AppendEntriesRequest<TypeConfig> =
                serde_json::from_slice(body).map_err(RpcServeError::BadRequest)?;
            serde_json::to_vec(&raft.append_entries(req).await).map_err(RpcServeError::Encode)
        }
        RpcKind::Vote => {
            let req: VoteRequest<u64> =
                serde_json::from_slice(body).map_err(RpcServeError::BadRequest)?;
            serde_json::to_vec(&raft.vote(req).await).map_err(RpcServeError::Encode)
        }
        RpcKind::Snapshot => {
            let req: InstallSnapshotRequest<TypeConfig> =
                serde_json::from_slice(body).map_err(RpcServeError::BadRequest)?;
            serde_json::to_vec(&raft.install_snapshot(req).await).map_err(RpcServeError::Encode)
        }
    }
}
