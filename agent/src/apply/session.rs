//! Opening a stream's apply session(s): the session settings (replica
//! role, commit durability, planner settings), the pipelined session of
//! the fast path, the peer's replication origin bound to each lane, the
//! stored progress the stream resumes from, the prepared control
//! statements, stored watermark and skip requests.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use mm_proto::Lsn;

use super::applier::{Applier, ApplyContext, WAL_POSITIONS, Watermark, parse_lsn};
use super::pipeline::{Pipeline, Stmt, StmtNames};
use super::{ApplyFailure, Param, sql};

/// Statements in flight per transaction before we wait for replies.
const PIPELINE_WINDOW: usize = 2048;

impl Applier {
    /// Opens the apply session for the stream from `peer`: replica role (no
    /// user triggers, no FK checks fired twice), the requested commit
    /// durability, and the peer's replication origin bound to the session (it
    /// tags our commits so they are never sent back out). Returns the stored
    /// progress: where the stream must resume.
    ///
    /// With `lanes` > 1 it opens that many sessions (`lanes.rs`), each
    /// with its own origin; `origin` names the stream's progress row.
    pub async fn open(
        dsn: &str,
        password: Option<&str>,
        origin: &str,
        synchronous_commit: &str,
        ctx: ApplyContext,
        lanes: usize,
    ) -> Result<(Applier, Lsn), ApplyFailure> {
        let (mut applier, start) = Self::open_lane(
            dsn,
            password,
            origin,
            synchronous_commit,
            ctx.clone(),
            0,
            lanes > 1,
        )
        .await?;
        if lanes > 1 {
            let mut side = Vec::with_capacity(lanes - 1);
            for k in 1..lanes {
                let (a, _) = Self::open_lane(
                    dsn,
                    password,
                    origin,
                    synchronous_commit,
                    ctx.clone(),
                    k,
                    true,
                )
                .await?;
                side.push(a);
            }
            // Every lane's origin exists now: each lane must know them all
            // as the publisher's (a version another lane wrote is its own).
            applier.load_origins().await?;
            for a in &mut side {
                a.load_origins().await?;
            }
            applier.lanes = Some(Box::new(super::lanes::Lanes::new(&applier.ctx.peer, side)));
        }
        Ok((applier, start))
    }

    async fn open_lane(
        dsn: &str,
        password: Option<&str>,
        origin: &str,
        synchronous_commit: &str,
        ctx: ApplyContext,
        lane: usize,
        lanes: bool,
    ) -> Result<(Applier, Lsn), ApplyFailure> {
        let client = crate::pg::connect(dsn, password)
            .await
            .map_err(|e| ApplyFailure::new(None, e.to_string()))?;
        let pg = |e: tokio_postgres::Error| ApplyFailure::from_pg(None, &e);
        let synchronous_commit = match synchronous_commit {
            "on" | "off" | "local" | "remote_write" | "remote_apply" => synchronous_commit,
            _ => "off",
        };
        let mut settings = vec![
            "SET session_replication_role = replica".to_owned(),
            format!("SET synchronous_commit = {synchronous_commit}"),
        ];
        settings.extend(super::sql::PLANNER_SETTINGS.map(str::to_owned));
        client
            .batch_execute(&settings.join("; "))
            .await
            .map_err(pg)?;
        // The fast path's own session (`pipeline.rs`). Without it (an
        // option of the DSN only tokio-postgres knows) the fast path runs
        // on the client session: slower, not wrong.
        let session = match crate::pg::connect_pipelined(dsn, password, &settings).await {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(peer = %ctx.peer, error = %e,
                    "cannot open the pipelined apply session; applying on the client session");
                None
            }
        };
        let bound = crate::stream::names::lane_origin_name(&ctx.peer, lane);
        crate::pg::bind_origin(&client, &bound).await.map_err(|e| {
            let mut f = ApplyFailure::from_pg(None, &e);
            if f.sqlstate.as_deref() == Some("53400") {
                f.message = format!(
                    "no free replication origin slot for apply lane {lane} of the stream from {} ({bound}): \
                     max_active_replication_origins must be at least (nodes - 1) x replication.apply_lanes + 1 \
                     ({})",
                    ctx.peer, f.message
                );
            }
            f
        })?;
        client
            .execute(
                "INSERT INTO mm.apply_progress (origin, remote_lsn) VALUES ($1, '0/0') \
                 ON CONFLICT (origin) DO NOTHING",
                &[&origin],
            )
            .await
            .map_err(pg)?;
        let row = client
            .query_one(
                "SELECT remote_lsn::text FROM mm.apply_progress WHERE origin = $1",
                &[&origin],
            )
            .await
            .map_err(pg)?;
        let start = parse_lsn(row.get(0), "stored apply progress")?;
        // Prepared on the client session for the careful path (and for the
        // pipeline when it has no session of its own).
        let stmt_names = StmtNames::default();
        let mut control = Vec::new();
        for text in [
            "BEGIN",
            "COMMIT",
            &sql::lane_turn(),
            sql::LANE_WAIT,
            sql::LANE_TOKEN,
            sql::LANE_RELEASE,
            // One statement records progress (only if the previous
            // transaction's is in place: see pipeline.rs) and gives the
            // commit the remote commit timestamp through the origin
            // (schema.rs).
            &sql::advance_progress(),
            &sql::advance_group_progress(),
        ] {
            let prepared = client.prepare(text).await.map_err(pg)?;
            control.push(Stmt::prepared(text, prepared, stmt_names.next()));
        }
        let [
            begin,
            commit,
            lane_turn,
            lane_wait,
            lane_token,
            lane_release,
            advance,
            advance_group,
        ]: [Stmt; 8] = control
            .try_into()
            .map_err(|_| ApplyFailure::new(None, "internal: control statements"))?;
        let wal_positions = client.prepare(WAL_POSITIONS).await.map_err(pg)?;
        let store_watermark = client
            .prepare("UPDATE mm.apply_progress SET watermark = $2::text::jsonb WHERE origin = $1")
            .await
            .map_err(pg)?;
        let stored_wm: Option<serde_json::Value> = client
            .query_one(
                "SELECT watermark FROM mm.apply_progress WHERE origin = $1",
                &[&origin],
            )
            .await
            .map_err(pg)?
            .get(0);
        let skip_rows = client
            .query(
                "SELECT commit_lsn::text FROM mm.skip_requests WHERE from_node = $1",
                &[&ctx.peer],
            )
            .await
            .map_err(pg)?;
        let mut skips = HashSet::new();
        for r in skip_rows {
            skips.insert(parse_lsn(r.get(0), "mm.skip_requests.commit_lsn")?);
        }
        let client = Arc::new(client);
        let mut pipe = Pipeline::new(Arc::clone(&client), PIPELINE_WINDOW);
        if let Some(session) = session {
            pipe = pipe.with_session(session, &bound);
            if lanes {
                pipe = pipe.eager();
            }
        }
        let mut applier = Applier {
            pipe: Some(pipe),
            stmt_names,
            next_expected: start,
            client,
            origin: origin.to_owned(),
            ctx,
            peer_roidents: Vec::new(),
            peer_param: Param::oid_array(&[]),
            origins: HashMap::new(),
            origin_params: (Param::oid_array(&[]), Param::text_array(&[])),
            wm: Arc::new(Watermark::none()),
            store_watermark,
            queued: VecDeque::new(),
            skips,
            routine_fast: 0,
            routine_careful: 0,
            routine_taken: 0,
            streak: 0,
            hot: Default::default(),
            relations: HashMap::new(),
            begin,
            advance,
            advance_group,
            group: super::group::Group::default(),
            commit,
            wal_positions,
            last_applied: start,
            durability: Default::default(),
            txn_open: false,
            early: None,
            careful_stmts: std::sync::Mutex::new(HashMap::new()),
            deferred: Default::default(),
            fk_pending: Vec::new(),
            origin_client: None,
            lanes: None,
            turn: None,
            gate_ticket: None,
            routine_side: 0,
            lane_turn,
            lane_wait,
            lane_token,
            lane_release,
        };
        applier.load_origins().await?;
        if let Some(wm) = stored_wm
            .and_then(|v| serde_json::from_value::<BTreeMap<String, DateTime<Utc>>>(v).ok())
        {
            applier.install_watermark(wm).await?;
        }
        if applier.peer_roidents.is_empty() {
            return Err(ApplyFailure::new(
                None,
                format!("replication origin {origin} vanished"),
            ));
        }
        // What we read is committed but, with asynchronous commit, maybe not
        // yet flushed: it only becomes durable through the same gate.
        applier.durable_progress().await?;
        Ok((applier, start))
    }
}
