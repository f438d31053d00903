//! The server's pool manager: the embedded one (a [`PoolCore`] in this
//! process, reached through a [`LocalPool`] session) or a `cxlkv pool`
//! daemon ([`RemotePool`]); either way the directory driver sees one
//! [`PoolService`] session.
//!
//! Start-up is where a restarted server becomes a restarted directory: the
//! pool manager is asked for every region it holds for this directory id
//! ([`recover`]); the server confirms them to the pool manager at once (its
//! reaper would otherwise reclaim them after its own grace period), and
//! hands those confirmed to `Directory::recover`, which keeps those whose owners
//! reattach within the instance grace period and frees the others.

use std::sync::Arc;
use std::time::Duration;

use cxlkv_controlplane::directory::{InstanceId, RecoveredRegion};
use cxlkv_controlplane::pool::service::{
    LocalPool, PoolCore, PoolReply, PoolRequest, PoolService, PoolServiceError, PoolSession,
    RemoteConfig, RemotePool, ServiceConfig,
};
use cxlkv_controlplane::proto::{self, ErrorCode, RegionHandle};

use super::{ServerError, wire};
use crate::client::ErrorChain;

/// How long start-up waits for each answer of the pool manager.
const POOL_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Most pages of `ListRegions` read at start-up (16 M regions).
const MAX_LIST_PAGES: usize = 4096;
/// How long start-up retries a pool daemon that still binds this directory
/// to its previous process (`instance_in_use`): a restart comes right after
/// the old server exited, and the daemon notices a local directory
/// process's death within its probe interval (at most 1 s).
const ATTACHED_ELSEWHERE_RETRY_MS: u64 = 10_000;
const ATTACHED_ELSEWHERE_PAUSE_MS: u64 = 50;

/// Where the server's pool manager runs.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum PoolManagerConfig {
    /// In this process (the default of `cxlkv serve`).
    Embedded(ServiceConfig),
    /// A `cxlkv pool` daemon, shared with other directories.
    Remote(RemoteConfig),
}

/// An open pool-manager session, and the embedded manager if there is one.
pub(crate) struct OpenedPool {
    pub service: Arc<dyn PoolService>,
    pub session: PoolSession,
    pub core: Option<PoolCore>,
}

/// Starts (embedded) or connects to (remote) the pool manager and opens this
/// directory's session.
pub(crate) fn open(cfg: &PoolManagerConfig, directory_id: &str) -> Result<OpenedPool, ServerError> {
    match cfg {
        PoolManagerConfig::Embedded(service_cfg) => {
            let core = PoolCore::start(service_cfg.clone()).map_err(|e| {
                // The whole chain: this error keeps text only, and "cannot
                // open pool P" without its cause does not say why.
                ServerError::PoolService(format!("cannot start: {}", ErrorChain(&e)))
            })?;
            let (local, session): (LocalPool, PoolSession) = core
                .attach_local(directory_id, POOL_CALL_TIMEOUT)
                .map_err(|e| ServerError::PoolService(e.to_string()))?;
            Ok(OpenedPool {
                service: Arc::new(local),
                session,
                core: Some(core),
            })
        }
        PoolManagerConfig::Remote(remote) => {
            let mut remote = remote.clone();
            remote.directory_id = directory_id.to_owned();
            let started = std::time::Instant::now();
            let mut told = false;
            let (pool, session) = loop {
                match RemotePool::connect(remote.clone()) {
                    Ok(opened) => break opened,
                    Err(e) if e.error_code() == Some(ErrorCode::InstanceInUse) => {
                        if started.elapsed() >= Duration::from_millis(ATTACHED_ELSEWHERE_RETRY_MS) {
                            return Err(attached_elsewhere(directory_id, &e));
                        }
                        // Once: the retries are every 50 ms for seconds.
                        if !told {
                            told = true;
                            tracing::info!(
                                error = %e,
                                directory_id,
                                retry_for_ms = ATTACHED_ELSEWHERE_RETRY_MS,
                                "the pool daemon still binds this directory id to another \
                                 process (a previous server not yet seen gone, or a live one); \
                                 retrying"
                            );
                        }
                        std::thread::sleep(Duration::from_millis(ATTACHED_ELSEWHERE_PAUSE_MS));
                    }
                    Err(e) => return Err(ServerError::PoolService(e.to_string())),
                }
            };
            Ok(OpenedPool {
                service: Arc::new(pool),
                session,
                core: None,
            })
        }
    }
}

/// The pool daemon kept `directory_id` bound to another process for the
/// whole of [`ATTACHED_ELSEWHERE_RETRY_MS`]: that process is alive — most
/// likely another server under the same id (a copied configuration).
fn attached_elsewhere(directory_id: &str, e: &PoolServiceError) -> ServerError {
    ServerError::PoolService(format!(
        "directory id {directory_id:?} is in use at the pool daemon by another live process \
         (still after {} s): another server runs under this id — stop it, or give this one \
         its own [server] directory_id (--directory-id): every directory sharing a pool \
         daemon needs a unique one ({e})",
        ATTACHED_ELSEWHERE_RETRY_MS / 1000
    ))
}

fn call(pool: &dyn PoolService, request: PoolRequest) -> Result<PoolReply, ServerError> {
    pool.call(request, POOL_CALL_TIMEOUT)
        .map_err(|e| ServerError::PoolService(e.to_string()))
}

fn unexpected(what: &str, reply: &PoolReply) -> ServerError {
    ServerError::PoolService(format!("unexpected answer to {what}: {reply:?}"))
}

/// Every region the pool manager holds for this directory, confirmed to it,
/// as the directory recovers them.
pub(crate) fn recover(pool: &dyn PoolService) -> Result<Vec<RecoveredRegion>, ServerError> {
    let mut handles: Vec<RegionHandle> = Vec::new();
    let mut after_region = 0;
    let mut pages = 0;
    loop {
        pages += 1;
        if pages > MAX_LIST_PAGES {
            return Err(ServerError::PoolService(format!(
                "more than {MAX_LIST_PAGES} pages of regions"
            )));
        }
        let list = match call(
            pool,
            PoolRequest::List {
                after_region,
                max_handles: proto::MAX_LIST_REGIONS as u32,
            },
        )? {
            PoolReply::Regions(list) => list,
            other => return Err(unexpected("ListRegions", &other)),
        };
        after_region = list
            .handles
            .iter()
            .map(|h| h.region)
            .max()
            .unwrap_or(after_region);
        let more = list.more && !list.handles.is_empty();
        handles.extend(list.handles);
        if !more {
            break;
        }
    }
    let mut refused = std::collections::HashSet::new();
    for chunk in handles.chunks(proto::MAX_REATTACH_REGIONS) {
        match call(
            pool,
            PoolRequest::Reattach {
                handles: chunk.to_vec(),
            },
        )? {
            PoolReply::Reattached(r) => {
                for no in &r.refused {
                    tracing::warn!(
                        region = no.region,
                        code = no.code,
                        "the pool manager did not confirm a region of this directory; not recovered"
                    );
                    refused.insert(no.region);
                }
            }
            other => return Err(unexpected("ReattachRegions", &other)),
        }
    }
    // A region refused here (reclaimed since it was listed, say) is not
    // this directory's any more: recovering it would let its owner reattach
    // to bytes the pool manager may grant to someone else.
    handles
        .iter()
        .filter(|h| !refused.contains(&h.region))
        .map(|h| {
            let owner = InstanceId::new(&h.owner.instance_id).map_err(|e| {
                ServerError::PoolService(format!("region {} has owner label {e}", h.region))
            })?;
            Ok(RecoveredRegion {
                handle: wire::dir_handle(h),
                owner,
            })
        })
        .collect()
}

/// The pools' fill levels.
pub(crate) fn usage(pool: &dyn PoolService) -> Result<Vec<proto::PoolUsage>, ServerError> {
    match call(pool, PoolRequest::Stats)? {
        PoolReply::Stats(s) => Ok(s.pools),
        other => Err(unexpected("PoolStats", &other)),
    }
}

/// Whether a failed free is worth sending again: the pool manager was busy,
/// slow or failing, not refusing this region.
pub(crate) fn worth_retrying(e: &PoolServiceError) -> bool {
    e.error_code()
        .is_none_or(|c| c.is_transient() || c == ErrorCode::Internal)
}

/// `fds` duplicated (each client gets its own copies, which the transport
/// closes once sent).
pub(crate) fn dup_fds(fds: &[std::os::fd::OwnedFd]) -> std::io::Result<Vec<std::os::fd::OwnedFd>> {
    use std::os::fd::AsFd;
    fds.iter()
        .map(|fd| fd.as_fd().try_clone_to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use cxlkv_controlplane::pool::service::{PoolCallback, PoolReply, PoolRequest, PoolService};
    use cxlkv_controlplane::proto::{
        OwnerLabel, PoolWelcome, RefusedRegion, RegionHandle, RegionList, RegionToken,
        RegionsReattached,
    };

    /// Lists two regions and refuses the second at the reattach (as a pool
    /// manager does for one its reaper reclaimed in between).
    #[derive(Debug)]
    struct ReclaimsOne;

    fn handle(region: u64) -> RegionHandle {
        RegionHandle {
            region,
            pool: 0,
            offset_bytes: region << 21,
            len_bytes: 1 << 21,
            owner: OwnerLabel {
                directory_id: "d".into(),
                instance_id: "i".into(),
            },
            token: RegionToken([region as u8; 32]),
        }
    }

    impl PoolService for ReclaimsOne {
        fn submit(&self, request: PoolRequest, done: PoolCallback) {
            done(Ok(match request {
                PoolRequest::List { .. } => PoolReply::Regions(RegionList {
                    handles: vec![handle(1), handle(2)],
                    more: false,
                }),
                PoolRequest::Reattach { .. } => PoolReply::Reattached(RegionsReattached {
                    accepted: vec![1],
                    refused: vec![RefusedRegion {
                        region: 2,
                        code: cxlkv_controlplane::proto::ErrorCode::UnknownRegion.as_u16(),
                    }],
                }),
                other => panic!("unexpected request {other:?}"),
            }))
        }

        fn welcome(&self) -> PoolWelcome {
            unreachable!("not asked")
        }
    }

    /// Found by a review of the server (session 23).
    #[test]
    fn a_region_the_pool_manager_refuses_at_the_reattach_is_not_recovered() {
        let recovered = super::recover(&ReclaimsOne).unwrap();
        let ids: Vec<u64> = recovered.iter().map(|r| r.handle.region.0).collect();
        assert_eq!(ids, vec![1]);
    }
}
