//! What inject adds: the sidecar container, its config volume, and the
//! resources beside the workloads (the ConfigMap with proxy.yaml and
//! filters.yaml, the client Service and the headless mesh Service). The same
//! container as `deploy/sidecar/sidecar-patch.yaml`, plus the node IP and pod
//! name from the downward API.

use serde_yaml_ng::{Mapping, Value};

/// The init container's name (one per pod).
pub const CONTAINER: &str = "kvmesh-proxy";
/// The config volume's name.
pub const VOLUME: &str = "kvmesh-config";
/// Where the ConfigMap is mounted.
pub const MOUNT: &str = "/etc/kvmesh";
/// The pod label the Services select.
pub const LABEL: &str = "kvmesh.io/inject";
/// On every injected template and generated resource: the version that injected it.
pub const INJECTED: &str = "kvmesh.dev/injected";
/// On injected templates: what inject created that was absent before (so
/// uninject removes exactly that), comma separated.
pub const CREATED: &str = "kvmesh.dev/created";

/// The sidecar's ports, from the proxy.yaml it runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ports {
    pub client: u16,
    pub admin: u16,
    /// The mesh port; `None` when the config has no `mesh.listen`.
    pub mesh: Option<u16>,
}

/// Everything inject needs to know; built once per invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InjectOptions {
    pub image: String,
    /// proxy.yaml, as the ConfigMap carries it.
    pub proxy_yaml: String,
    /// filters.yaml, when one was given.
    pub filters_yaml: Option<String>,
    pub ports: Ports,
    /// Emit the headless `kvmesh-mesh` Service the mesh backend's DNS
    /// discovery resolves (with a mesh port); not with `index.backend:
    /// valkey`, whose pods find each other through Valkey.
    pub mesh_service: bool,
    /// Flags appended to `run` (`--role=decode`, `--model=...`, `--pd-connector=...`).
    pub extra_args: Vec<String>,
    /// The version recorded in [`INJECTED`].
    pub version: String,
}

impl InjectOptions {
    /// The ConfigMap's name: a content hash, so an edit rolls the pods (as
    /// kustomize's generator does; the hash itself is ours, FNV-1a).
    pub fn config_map_name(&self) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut feed = |bytes: &[u8]| {
            for b in bytes {
                h ^= u64::from(*b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        };
        feed(b"proxy.yaml\0");
        feed(self.proxy_yaml.as_bytes());
        if let Some(f) = &self.filters_yaml {
            feed(b"\0filters.yaml\0");
            feed(f.as_bytes());
        }
        format!("kvmesh-proxy-{:010x}", h & 0xff_ffff_ffff)
    }

    /// The native sidecar: an init container that keeps running.
    pub fn container(&self) -> Value {
        let p = self.ports;
        let mut args = vec![
            "run".to_owned(),
            format!("--config={MOUNT}/proxy.yaml"),
            format!("--advertise=$(POD_IP):{}", p.client),
            // The node's kvagent (a hostNetwork DaemonSet), announced over
            // the mesh as where this pod's KV blocks go (docs/pd.md).
            "--node-ip=$(NODE_IP)".to_owned(),
        ];
        if self.filters_yaml.is_some() {
            args.push(format!("--filters={MOUNT}/filters.yaml"));
        }
        args.extend(self.extra_args.iter().cloned());
        let port = |name: &str, n: u16| map([("name", s(name)), ("containerPort", n.into())]);
        let mut ports = vec![port("kvmesh-http", p.client), port("kvmesh-admin", p.admin)];
        if let Some(mesh) = p.mesh {
            ports.push(port("kvmesh-mesh", mesh));
        }
        let env = |name: &str, path: &str| {
            map([
                ("name", s(name)),
                (
                    "valueFrom",
                    map([("fieldRef", map([("fieldPath", s(path))]))]),
                ),
            ])
        };
        let probe = |path: &str| map([("path", s(path)), ("port", p.admin.into())]);
        map([
            ("name", s(CONTAINER)),
            ("image", s(&self.image)),
            ("restartPolicy", s("Always")),
            (
                "args",
                Value::Sequence(args.into_iter().map(Value::String).collect()),
            ),
            (
                "env",
                Value::Sequence(vec![
                    env("POD_IP", "status.podIP"),
                    env("NODE_IP", "status.hostIP"),
                    env("POD_NAME", "metadata.name"),
                ]),
            ),
            ("ports", Value::Sequence(ports)),
            (
                "readinessProbe",
                map([("httpGet", probe("/ready")), ("periodSeconds", 2.into())]),
            ),
            ("livenessProbe", map([("httpGet", probe("/health"))])),
            (
                "resources",
                map([
                    (
                        "requests",
                        map([("cpu", s("500m")), ("memory", s("256Mi"))]),
                    ),
                    ("limits", map([("memory", s("1Gi"))])),
                ]),
            ),
            (
                "volumeMounts",
                Value::Sequence(vec![map([
                    ("name", s(VOLUME)),
                    ("mountPath", s(MOUNT)),
                    ("readOnly", true.into()),
                ])]),
            ),
        ])
    }

    /// The pod volume with the ConfigMap.
    pub fn volume(&self) -> Value {
        map([
            ("name", s(VOLUME)),
            ("configMap", map([("name", s(&self.config_map_name()))])),
        ])
    }

    /// The ConfigMap, in `namespace` (the workload's; `None`: the default of `kubectl apply`).
    pub fn config_map(&self, namespace: Option<&str>) -> Value {
        let mut data = Mapping::new();
        data.insert(s("proxy.yaml"), s(&self.proxy_yaml));
        if let Some(f) = &self.filters_yaml {
            data.insert(s("filters.yaml"), s(f));
        }
        map([
            ("apiVersion", s("v1")),
            ("kind", s("ConfigMap")),
            (
                "metadata",
                self.metadata(&self.config_map_name(), namespace),
            ),
            ("data", Value::Mapping(data)),
        ])
    }

    /// `kvmesh` (clients, port 8000 to the sidecars) and, with a mesh port
    /// and `mesh_service`, the headless `kvmesh-mesh` the default proxy.yaml
    /// discovers peers with.
    pub fn services(&self, namespace: Option<&str>) -> Vec<Value> {
        let selector = || map([(LABEL, s("true"))]);
        let service_port = |name: &str, port: u16, target: u16| {
            Value::Sequence(vec![map([
                ("name", s(name)),
                ("port", port.into()),
                ("targetPort", target.into()),
            ])])
        };
        let service = |name: &str, spec: Value| {
            map([
                ("apiVersion", s("v1")),
                ("kind", s("Service")),
                ("metadata", self.metadata(name, namespace)),
                ("spec", spec),
            ])
        };
        let mut out = vec![service(
            "kvmesh",
            map([
                ("selector", selector()),
                ("ports", service_port("http", 8000, self.ports.client)),
            ]),
        )];
        if let Some(mesh) = self.ports.mesh.filter(|_| self.mesh_service) {
            out.push(service(
                "kvmesh-mesh",
                map([
                    ("clusterIP", s("None")),
                    ("selector", selector()),
                    ("ports", service_port("mesh", mesh, mesh)),
                ]),
            ));
        }
        out
    }

    fn metadata(&self, name: &str, namespace: Option<&str>) -> Value {
        let mut m = Mapping::new();
        m.insert(s("name"), s(name));
        if let Some(ns) = namespace {
            m.insert(s("namespace"), s(ns));
        }
        m.insert(
            s("labels"),
            map([("app.kubernetes.io/part-of", s("kvmesh"))]),
        );
        m.insert(s("annotations"), map([(INJECTED, s(&self.version))]));
        Value::Mapping(m)
    }
}

/// A string value.
pub(super) fn s(v: &str) -> Value {
    Value::String(v.to_owned())
}

/// A mapping with keys in the order given.
pub(super) fn map<const N: usize>(pairs: [(&str, Value); N]) -> Value {
    Value::Mapping(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
}
