//! The Kubernetes manifests, checked offline: every overlay renders (`kubectl kustomize`) and
//! validates against the Kubernetes schemas (`kubernetes-validate --strict`), every variable a
//! Reelay container is given is one the binary reads, and each rendered Reelay container runs
//! as a local process with its exact command, args and env (service DNS names and container
//! ports mapped to loopback ports, volumes to temp dirs): every probe answers as the kubelet
//! would ask it, and a review logged through the write service reaches search. A wrong flag or
//! variable name in a manifest fails here.
//!
//! On the cluster overlay NATS runs as a local 3-node JetStream cluster of the pinned server
//! (its StatefulSet's settings are checked on the rendered objects), so the stream really is
//! created with the overlay's 3 replicas.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use reelay_harness::{
    NatsServer, PORT_TRIES, eventually, free_port, listens_on, port_taken, run_cli, temp_dir, try_http_get,
};
use serde_json::Value;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const BIN: &str = env!("CARGO_BIN_EXE_reelay");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The dir `scripts/install-k8s-tools` installed kubectl and kubernetes-validate in
/// (`scripts/test` exports it; run here otherwise, once per test process).
fn tools() -> PathBuf {
    if let Some(dir) = std::env::var_os("REELAY_K8S_TOOLS") {
        return dir.into();
    }
    static INSTALLED: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            let out = Command::new(Path::new(ROOT).join("scripts/install-k8s-tools"))
                .output()
                .expect("run install-k8s-tools");
            assert!(out.status.success(), "install-k8s-tools failed:\n{}", String::from_utf8_lossy(&out.stderr));
            PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().lines().last().expect("it prints the dir"))
        })
        .clone()
}

/// `kubectl kustomize` of an overlay: the rendered YAML.
fn render(dir: &Path) -> String {
    let out = Command::new(tools().join("bin/kubectl")).arg("kustomize").arg(dir).output().unwrap();
    assert!(
        out.status.success(),
        "kubectl kustomize {} failed:\n{}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `kubernetes-validate --strict`: every object against the Kubernetes schemas. KEDA's
/// ScaledObject has no schema there (it is checked by hand below); nothing else may lack one.
fn validate(yaml: &str) -> Result<(), String> {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), yaml).unwrap();
    let out = Command::new("python3")
        .args(["-m", "kubernetes_validate", "--strict", "--quiet"])
        .arg(file.path())
        .env("PYTHONPATH", tools())
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let unexpected: Vec<&str> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .filter(|l| !l.contains("Couldn't find schema for kind ScaledObject with api version keda.sh/v1alpha1"))
        .collect();
    if out.status.success() && unexpected.is_empty() { Ok(()) } else { Err(text) }
}

/// The rendered objects, as JSON (PyYAML comes with kubernetes-validate).
fn objects(yaml: &str) -> Vec<Value> {
    let mut child = Command::new("python3")
        .args(["-c", "import sys, json, yaml; json.dump([d for d in yaml.safe_load_all(sys.stdin) if d], sys.stdout)"])
        .env("PYTHONPATH", tools())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(yaml.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    serde_json::from_slice(&out.stdout).unwrap()
}

fn overlay(name: &str) -> (String, Vec<Value>) {
    let yaml = render(&Path::new(ROOT).join("k8s/overlays").join(name));
    let objects = objects(&yaml);
    (yaml, objects)
}

fn kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

fn named<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn str_of(value: &Value) -> &str {
    value.as_str().unwrap_or_default()
}

/// Workloads whose containers run the Reelay image.
fn reelay_workloads(objects: &[Value]) -> Vec<&Value> {
    objects
        .iter()
        .filter(|o| o["kind"] == "Deployment" || o["kind"] == "StatefulSet")
        .filter(|o| {
            o["spec"]["template"]["spec"]["containers"]
                .as_array()
                .is_some_and(|cs| cs.iter().any(|c| str_of(&c["image"]).contains("reelay")))
        })
        .collect()
}

/// The environment variables `reelay run` reads, from its own `--help`.
fn known_variables() -> BTreeSet<String> {
    let out = Command::new(BIN).args(["run", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    help.split("[env: ").skip(1).filter_map(|rest| rest.split(['=', ']']).next()).map(str::to_owned).collect()
}

/// Every variable a Reelay container gets (its ConfigMap's and its own), by workload.
fn container_variables(objects: &[Value]) -> BTreeMap<String, BTreeSet<String>> {
    let mut found = BTreeMap::new();
    for workload in reelay_workloads(objects) {
        let name = str_of(&workload["metadata"]["name"]).to_owned();
        for container in workload["spec"]["template"]["spec"]["containers"].as_array().unwrap() {
            let vars: &mut BTreeSet<String> = found.entry(name.clone()).or_default();
            for from in container["envFrom"].as_array().into_iter().flatten() {
                let map = named(objects, "ConfigMap", str_of(&from["configMapRef"]["name"]));
                vars.extend(map["data"].as_object().unwrap().keys().cloned());
            }
            for env in container["env"].as_array().into_iter().flatten() {
                vars.insert(str_of(&env["name"]).to_owned());
            }
        }
    }
    found
}

/// The handlers that call remote servers: the federation handlers (an actor's document before a
/// Follow or an Undo, inboxes, outboxes), the enrichment handlers (the metadata provider), and
/// poster-sync (the posters).
const CALL_OUT: [&str; 6] = [
    "federation",
    "federation-delivery",
    "federation-backfill",
    "movie-enrichment",
    "person-enrichment",
    "poster-sync",
];

#[test]
fn every_overlay_renders_validates_and_names_only_real_settings() {
    let known = known_variables();
    assert!(known.contains("REELAY_METRICS_ADDR") && known.contains("EVENT_BUS_BACKEND"), "{known:?}");
    for name in ["local", "cluster"] {
        let (yaml, objects) = overlay(name);
        validate(&yaml).unwrap_or_else(|e| panic!("the {name} overlay does not validate:\n{e}"));
        for (workload, vars) in container_variables(&objects) {
            let unknown: Vec<&String> = vars.iter().filter(|v| !known.contains(*v)).collect();
            assert!(unknown.is_empty(), "{name}/{workload} sets variables reelay does not read: {unknown:?}");
        }
        for workload in reelay_workloads(&objects) {
            let spec = &workload["spec"]["template"]["spec"];
            let container = &spec["containers"][0];
            let args: Vec<&str> = container["args"].as_array().unwrap().iter().map(str_of).collect();
            // gRPC services are probed on their named health service; the relay on /readyz.
            let readiness = &container["readinessProbe"];
            match args.get(2).copied() {
                Some(service @ ("write" | "handlers")) => {
                    assert_eq!(readiness["grpc"]["service"], service, "{name}: {args:?} readiness names its service");
                }
                Some("relay" | "gateway") => assert_eq!(readiness["httpGet"]["path"], "/readyz"),
                other => panic!("{name}: unexpected service {other:?}"),
            }
            assert!(container["resources"]["limits"]["memory"].is_string(), "{name}: {args:?} has a memory limit");
            if args.get(2) == Some(&"gateway") {
                // After SIGTERM it serves on for its shutdown delay, then lets open requests run
                // for up to 60 s: not cut at 30.
                let delay_ms = container["env"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|v| v["name"] == "REELAY_SHUTDOWN_DELAY_MS")
                    .and_then(|v| str_of(&v["value"]).parse::<u64>().ok())
                    .expect("the gateway sets a shutdown delay, for the Ingress to stop routing to it");
                let grace = spec["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
                assert!(
                    grace * 1000 > 60_000 + delay_ms,
                    "{name}: the gateway's grace period {grace} s is under its {delay_ms} ms delay and 60 s drain"
                );
            }
            // What reaches remote servers may leave the cluster (the base denies all egress but
            // to pods with this label): the gateway fetches signers' keys, and these handlers
            // call out from their events.
            let calls_out = args.get(2) == Some(&"gateway")
                || args.windows(2).any(|pair| pair[0] == "--handler" && CALL_OUT.contains(&pair[1]));
            let label = &workload["spec"]["template"]["metadata"]["labels"]["reelay.dev/calls-internet"];
            assert_eq!(label == "true", calls_out, "{name}: {args:?} calls out: {calls_out}, labelled {label}");
            let annotations = &workload["spec"]["template"]["metadata"]["annotations"];
            assert_eq!(annotations["prometheus.io/port"], "9464", "{name}: {args:?} is scraped");
            // And the scrape is let in: the base denies every ingress but what a policy admits.
            let scrapes = named(&objects, "NetworkPolicy", "metrics-scrapes");
            let labels = &workload["spec"]["template"]["metadata"]["labels"];
            assert!(
                labels_match(&scrapes["spec"]["podSelector"]["matchLabels"], labels),
                "{name}: {args:?} pods ({labels}) are not let in to port 9464 by metrics-scrapes"
            );
        }
        // Pod Security's `restricted` level, which a namespace may enforce.
        for workload in kind(&objects, "Deployment").into_iter().chain(kind(&objects, "StatefulSet")) {
            let name = str_of(&workload["metadata"]["name"]);
            let pod = &workload["spec"]["template"]["spec"];
            assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{name}");
            assert_eq!(pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault", "{name}");
            for container in pod["containers"].as_array().unwrap() {
                let context = &container["securityContext"];
                assert_eq!(context["allowPrivilegeEscalation"], false, "{name}");
                assert_eq!(context["capabilities"]["drop"], serde_json::json!(["ALL"]), "{name}");
            }
        }
        assert!(!kind(&objects, "PodDisruptionBudget").is_empty());
        assert!(kind(&objects, "NetworkPolicy").iter().any(|p| p["metadata"]["name"] == "default-deny"));
    }

    // The cluster overlay: NATS as a durable 3-node JetStream cluster holding a 3-replica
    // stream, each handler scaled on its own consumer, and no token from this repository.
    let (_, objects) = overlay("cluster");
    let nats = named(&objects, "StatefulSet", "nats");
    assert_eq!(nats["spec"]["replicas"], 3);
    assert!(!nats["spec"]["volumeClaimTemplates"].as_array().unwrap().is_empty(), "the file store is on volumes");
    let conf = str_of(&named(&objects, "ConfigMap", "nats-config")["data"]["nats.conf"]);
    assert!(conf.contains("sync_interval: always") && conf.contains("store_dir: /data/"), "{conf}");
    for i in 0..3 {
        assert!(conf.contains(&format!("nats://nats-{i}.nats:6222")), "routes name every pod: {conf}");
    }
    let config = kind(&objects, "ConfigMap")
        .into_iter()
        .find(|c| str_of(&c["metadata"]["name"]).starts_with("reelay-config"))
        .unwrap();
    assert_eq!(config["data"]["REELAY_STREAM_REPLICAS"], "3");
    assert_eq!(config["data"]["EVENT_BUS_BACKEND"], "nats");
    // No token is shipped, so no apply overwrites the one the operator created.
    assert!(kind(&objects, "Secret").is_empty(), "the cluster overlay ships a Secret");
    let handlers: Vec<&Value> = reelay_workloads(&objects)
        .into_iter()
        .filter(|w| w["spec"]["template"]["spec"]["containers"][0]["args"][2] == "handlers")
        .collect();
    assert!(!handlers.is_empty());
    let mut deployed: Vec<String> = handlers
        .iter()
        .flat_map(|d| d["spec"]["template"]["spec"]["containers"][0]["args"].as_array().unwrap().windows(2))
        .filter(|pair| pair[0] == "--handler")
        .map(|pair| str_of(&pair[1]).to_owned())
        .collect();
    deployed.sort();
    let mut every: Vec<String> = reelay_handlers::names(&Default::default())
        .into_iter()
        .filter(|name| !name.starts_with("probe"))
        .map(str::to_owned)
        .collect();
    every.sort();
    assert_eq!(deployed, every, "every handler of the build has exactly one Deployment");
    for deployment in handlers {
        let args = deployment["spec"]["template"]["spec"]["containers"][0]["args"].as_array().unwrap();
        let handlers: Vec<String> =
            args.windows(2).filter(|pair| pair[0] == "--handler").map(|pair| str_of(&pair[1]).to_owned()).collect();
        assert!(!handlers.is_empty(), "a handlers Deployment names its handlers: {args:?}");
        let scaled = kind(&objects, "ScaledObject")
            .into_iter()
            .find(|s| s["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"])
            .unwrap_or_else(|| panic!("no ScaledObject for {handlers:?}"));
        let triggers = scaled["spec"]["triggers"].as_array().unwrap();
        let consumers: Vec<String> = triggers.iter().map(|t| str_of(&t["metadata"]["consumer"]).to_owned()).collect();
        let expected: Vec<String> = handlers.iter().map(|h| format!("handler-{h}")).collect();
        assert_eq!(consumers, expected, "KEDA reads each handler's own consumer");
        for trigger in triggers {
            assert_eq!(trigger["type"], "nats-jetstream");
            assert_eq!(trigger["metadata"]["stream"], "REELAY_EVENTS");
            assert!(str_of(&trigger["metadata"]["natsServerMonitoringEndpoint"]).starts_with("nats.reelay.svc"));
        }
    }
}

/// A manifest mistake is caught: a misspelt variable by the settings check, a misspelt flag by
/// the process that refuses it, a misplaced field by the schemas.
#[test]
fn a_wrong_flag_or_variable_is_caught() {
    let known = known_variables();
    assert!(!known.contains("REELAY_METRICS_ADRR"));
    let out = Command::new(BIN).args(["run", "--service", "write", "--handlers", "search"]).output().unwrap();
    assert!(!out.status.success(), "a wrong flag stops the process");
    let (yaml, _) = overlay("local");
    let broken = yaml.replacen("      containers:", "      containerz:", 1);
    assert!(validate(&broken).is_err(), "a wrong field fails --strict validation");
}

/// One loopback port per (Service, port), and per (pod, container port) for pods no Service
/// selects.
struct Network {
    namespace: String,
    services: HashMap<(String, u16), u16>,
}

impl Network {
    /// Rewrites every `<service>[.<ns>[.svc[.cluster.local]]]:<port>` to its loopback port.
    fn rewrite(&self, value: &str) -> String {
        let mut value = value.to_owned();
        for ((service, port), local) in &self.services {
            let ns = &self.namespace;
            for host in [
                format!("{service}.{ns}.svc.cluster.local"),
                format!("{service}.{ns}.svc"),
                format!("{service}.{ns}"),
                service.clone(),
            ] {
                value = value.replace(&format!("//{host}:{port}"), &format!("//127.0.0.1:{local}"));
            }
        }
        value
    }
}

/// One pod of a rendered workload, as a local process.
struct Pod {
    name: String,
    child: Child,
    log: PathBuf,
    /// containerPort → loopback port.
    ports: HashMap<u16, u16>,
    container: Value,
    env: Vec<(String, String)>,
}

impl Drop for Pod {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- pod {} ---\n{}", self.name, std::fs::read_to_string(&self.log).unwrap_or_default());
        }
    }
}

fn labels_match(selector: &Value, labels: &Value) -> bool {
    selector.as_object().is_some_and(|s| !s.is_empty() && s.iter().all(|(k, v)| &labels[k] == v))
}

/// Starts pod `index` of `workload` as a process of the built binary: the container's command
/// (`reelay` is this build) and args as written; its env from its ConfigMap and its own entries
/// (a pod name for `fieldRef: metadata.name`); each volume a dir of its own holding a Secret's or
/// ConfigMap's files; addresses mapped by `network`.
fn start_pod(
    workload: &Value,
    index: u64,
    objects: &[Value],
    network: &Network,
    dir: &Path,
    secrets: &HashMap<String, String>,
) -> Pod {
    let name = str_of(&workload["metadata"]["name"]);
    let template = &workload["spec"]["template"];
    let container = template["spec"]["containers"][0].clone();
    let pod = format!("{name}-{index}");
    let root = dir.join(&pod);
    // Volumes: mountPath → local dir.
    let mut mounts: Vec<(String, PathBuf)> = Vec::new();
    for mount in container["volumeMounts"].as_array().into_iter().flatten() {
        let volume_name = str_of(&mount["name"]);
        let local = root.join(volume_name);
        std::fs::create_dir_all(&local).unwrap();
        let volume = template["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["name"] == volume_name)
            .cloned()
            .unwrap_or(Value::Null); // a volumeClaimTemplate: an empty volume
        // A Secret the overlay renders, or else the operator's (`secrets`: its `token` file).
        if let Some(secret) = volume["secret"]["secretName"].as_str() {
            match objects.iter().find(|o| o["kind"] == "Secret" && o["metadata"]["name"] == secret) {
                Some(object) => {
                    for (file, value) in object["stringData"].as_object().expect("secrets are given as stringData") {
                        std::fs::write(local.join(file), str_of(value)).unwrap();
                    }
                }
                None => {
                    let token = secrets.get(secret).unwrap_or_else(|| panic!("{name}: no Secret {secret}"));
                    std::fs::write(local.join("token"), token).unwrap();
                }
            }
        }
        if let Some(map) = volume["configMap"]["name"].as_str() {
            for (file, value) in named(objects, "ConfigMap", map)["data"].as_object().unwrap() {
                std::fs::write(local.join(file), str_of(value)).unwrap();
            }
        }
        mounts.push((str_of(&mount["mountPath"]).to_owned(), local));
    }
    let local_path = |value: &str| -> String {
        for (mount, local) in &mounts {
            if let Some(rest) = value.strip_prefix(mount.as_str())
                && (rest.is_empty() || rest.starts_with('/'))
            {
                return format!("{}{rest}", local.display());
            }
        }
        value.to_owned()
    };
    // Container ports: the Service selecting this pod decides the loopback port.
    let mut ports = HashMap::new();
    for port in container["ports"].as_array().into_iter().flatten() {
        let number = port["containerPort"].as_u64().unwrap() as u16;
        let served = kind(objects, "Service").into_iter().find_map(|s| {
            if !labels_match(&s["spec"]["selector"], &template["metadata"]["labels"]) {
                return None;
            }
            let sp = s["spec"]["ports"]
                .as_array()?
                .iter()
                .find(|sp| sp["targetPort"] == port["name"] || sp["targetPort"] == number)?;
            network.services.get(&(str_of(&s["metadata"]["name"]).to_owned(), sp["port"].as_u64()? as u16)).copied()
        });
        // A port of its own: not one set aside for a Service whose pod has not bound it yet.
        let own = || loop {
            let port = free_port();
            if !network.services.values().chain(ports.values()).any(|taken| *taken == port) {
                break port;
            }
        };
        let local = served.unwrap_or_else(own);
        ports.insert(number, local);
    }
    let mut env: Vec<(String, String)> = Vec::new();
    for from in container["envFrom"].as_array().into_iter().flatten() {
        let map = named(objects, "ConfigMap", str_of(&from["configMapRef"]["name"]));
        for (key, value) in map["data"].as_object().unwrap() {
            env.push((key.clone(), str_of(value).to_owned()));
        }
    }
    for entry in container["env"].as_array().into_iter().flatten() {
        let value = if let Some(value) = entry["value"].as_str() {
            value.to_owned()
        } else if entry["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name" {
            pod.clone()
        } else if let Some(key) = entry["valueFrom"]["configMapKeyRef"].as_object() {
            str_of(&named(objects, "ConfigMap", str_of(&key["name"]))["data"][str_of(&key["key"])]).to_owned()
        } else {
            panic!("{pod}: an env entry this test cannot resolve: {entry}");
        };
        env.retain(|(k, _)| k != str_of(&entry["name"]));
        env.push((str_of(&entry["name"]).to_owned(), value));
    }
    let env: Vec<(String, String)> = env
        .into_iter()
        .map(|(key, value)| {
            let mut value = network.rewrite(&local_path(&value));
            for (container_port, local) in &ports {
                value = value.replace(&format!("0.0.0.0:{container_port}"), &format!("127.0.0.1:{local}"));
            }
            (key, value)
        })
        .collect();
    let command: Vec<&str> = container["command"].as_array().expect("an explicit command").iter().map(str_of).collect();
    assert_eq!(command, ["reelay"], "{pod} runs the reelay binary");
    let args: Vec<String> = container["args"].as_array().unwrap().iter().map(|a| local_path(str_of(a))).collect();
    let log = root.join("pod.log");
    let file = std::fs::File::create(&log).unwrap();
    let child = Command::new(BIN)
        .args(&args)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .current_dir(&root)
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .spawn()
        .unwrap();
    Pod { name: pod, child, log, ports, container, env }
}

/// Starts pod `index` of `workload` (see [`start_pod`]) and waits until it listens on every
/// port of its container. A port chosen for it may be taken by another test's server before
/// the pod binds it: the pod then exits saying so, and is started again with the ports of the
/// Services it serves moved to fresh ones (no pod started before it is pointed at them).
async fn start_listening_pod(
    workload: &Value,
    index: u64,
    objects: &[Value],
    network: &mut Network,
    dir: &Path,
    secrets: &HashMap<String, String>,
    started: &[Pod],
) -> Pod {
    for _ in 0..PORT_TRIES {
        let mut pod = start_pod(workload, index, objects, network, dir, secrets);
        let Some(log) = listening_or_exited(&mut pod).await else { return pod };
        assert!(port_taken(&log), "{} exited before listening:\n{log}", pod.name);
        let served: Vec<u16> = pod.ports.values().copied().collect();
        for local in network.services.values_mut().filter(|local| served.contains(local)) {
            let moved = *local;
            let points_at_it = |value: &str| {
                value
                    .split("127.0.0.1:")
                    .skip(1)
                    .any(|rest| rest.split(|c: char| !c.is_ascii_digit()).next() == Some(moved.to_string().as_str()))
            };
            assert!(
                !started.iter().any(|p| p.env.iter().any(|(_, value)| points_at_it(value))),
                "{}: a pod started before it is pointed at its port {moved}",
                pod.name
            );
            *local = free_port();
        }
        eprintln!("{}: a port chosen for it was taken before it bound it; starting it on fresh ports", pod.name);
    }
    panic!("pod {index} of {} found a port taken {PORT_TRIES} times", str_of(&workload["metadata"]["name"]));
}

/// Waits until the pod's process listens on every port of its container: None, or its log if
/// it exited first.
async fn listening_or_exited(pod: &mut Pod) -> Option<String> {
    let waited = std::time::Instant::now();
    loop {
        if pod.child.try_wait().expect("the pod's process can be waited for").is_some() {
            return Some(std::fs::read_to_string(&pod.log).unwrap_or_default());
        }
        if pod.ports.values().all(|&port| listens_on(pod.child.id(), port)) {
            return None;
        }
        assert!(
            waited.elapsed() < Duration::from_secs(60),
            "{} does not listen on all of {:?} after 60 s",
            pod.name,
            pod.ports
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Asks every probe of `pod` as the kubelet would, until each passes.
async fn probes_pass(pod: &Pod) {
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let spec = &pod.container[probe];
        if spec.is_null() {
            continue;
        }
        let port_of = |port: &Value| -> u16 {
            let number = match port.as_u64() {
                Some(n) => n as u16,
                None => pod.container["ports"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|p| p["name"] == *port)
                    .and_then(|p| p["containerPort"].as_u64())
                    .unwrap_or_else(|| panic!("{}: {probe} names no container port {port}", pod.name))
                    as u16,
            };
            pod.ports[&number]
        };
        let what = format!("{}'s {probe} passes", pod.name);
        if let Some(grpc) = spec["grpc"].as_object() {
            let port = port_of(&grpc["port"]);
            let service = grpc.get("service").map(str_of).unwrap_or_default().to_owned();
            eventually(&what, Duration::from_secs(60), || {
                let service = service.clone();
                async move {
                    let Ok(channel) = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
                        .unwrap()
                        .connect()
                        .await
                    else {
                        return false;
                    };
                    let reply = HealthClient::new(channel).check(HealthCheckRequest { service }).await;
                    reply.is_ok_and(|r| r.into_inner().status == ServingStatus::Serving as i32)
                }
            })
            .await;
        } else if let Some(http) = spec["httpGet"].as_object() {
            let (port, path) = (port_of(&http["port"]), str_of(&http["path"]).to_owned());
            eventually(&what, Duration::from_secs(60), || {
                let path = path.clone();
                async move {
                    try_http_get(format!("127.0.0.1:{port}").parse().unwrap(), &path)
                        .await
                        .is_some_and(|(code, _)| code == 200)
                }
            })
            .await;
        } else {
            panic!("{}: {probe} is neither gRPC nor HTTP", pod.name);
        }
    }
}

/// Runs an overlay's Reelay workloads as rendered: write first, then the rest; checks every
/// probe, then logs a review through the CLI and finds it through search; stops every process
/// with SIGTERM and expects clean exits. With `taken`, the loopback port chosen for that
/// Service port is taken by another server before its pod starts (as another test's server
/// may take it), and the pod must come up on fresh ports.
async fn run_overlay(overlay_name: &str, nats: Option<&NatsServer>, taken: Option<(&str, u16)>) {
    let (_, objects) = overlay(overlay_name);
    let namespace = str_of(&kind(&objects, "Namespace")[0]["metadata"]["name"]).to_owned();
    let mut services = HashMap::new();
    for service in kind(&objects, "Service") {
        let name = str_of(&service["metadata"]["name"]).to_owned();
        for port in service["spec"]["ports"].as_array().unwrap() {
            let number = port["port"].as_u64().unwrap() as u16;
            let local = match (name.as_str(), number, nats) {
                ("nats", 4222, Some(nats)) => nats.port,
                ("nats", 8222, Some(nats)) => nats.monitor_port,
                _ => free_port(),
            };
            services.insert((name.clone(), number), local);
        }
    }
    let mut network = Network { namespace, services };
    let _squatter = taken.map(|(service, port)| {
        let local = network.services[&(service.to_owned(), port)];
        std::net::TcpListener::bind(("127.0.0.1", local)).expect("take the port first")
    });
    let dir = temp_dir();
    // What an operator creates before the first deploy when the overlay ships no token.
    let secrets = HashMap::from([("reelay-service-token".to_owned(), "operator-set-token-0123456789".to_owned())]);
    let mut workloads = reelay_workloads(&objects);
    workloads.sort_by_key(|w| w["spec"]["template"]["spec"]["containers"][0]["args"][2] != "write");
    let mut pods = Vec::new();
    for workload in workloads {
        for index in 0..workload["spec"]["replicas"].as_u64().unwrap_or(1) {
            let pod = start_listening_pod(workload, index, &objects, &mut network, dir.path(), &secrets, &pods).await;
            probes_pass(&pod).await;
            pods.push(pod);
        }
    }
    let pod =
        |args2: &str| pods.iter().find(|p| p.container["args"][2] == args2).unwrap_or_else(|| panic!("a {args2} pod"));
    let write = pod("write");
    let search = pods
        .iter()
        .find(|p| p.container["args"].as_array().unwrap().iter().any(|a| a == "search"))
        .expect("a search pod");
    for p in &pods {
        let (code, _) =
            try_http_get(format!("127.0.0.1:{}", p.ports[&9464]).parse().unwrap(), "/metrics").await.unwrap();
        assert_eq!(code, 200, "{} serves metrics", p.name);
    }

    // The client, as an operator would run it in the write pod (its env, the mounted token).
    let env: Vec<(String, String)> = write
        .env
        .iter()
        .cloned()
        .chain([
            ("REELAY_WRITE_URL".to_owned(), format!("http://127.0.0.1:{}", write.ports[&50051])),
            ("REELAY_HANDLERS_URL".to_owned(), format!("http://127.0.0.1:{}", search.ports[&50052])),
        ])
        .collect();
    let cli = |args: Vec<String>| {
        let env = env.clone();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run_cli(Path::new(BIN), &args, &env).await
        }
    };
    let user = cli(vec!["users".into(), "create".into(), "ana".into()]).await;
    let user = user.ok().trim().to_owned();
    let logged =
        cli(["reviews", "log", "--user", &user, "--movie", "Heat", "--year", "1995", "--review", "The diner scene."]
            .map(String::from)
            .to_vec())
        .await;
    logged.ok();
    eventually("the review reaches search", Duration::from_secs(30), || async {
        cli(vec!["search".into(), "reviews".into(), "diner".into()]).await.stdout.contains("1 review(s) found")
    })
    .await;
    let status = cli(vec!["status".into()]).await;
    assert!(status.ok().contains("search"), "{}", status.stdout);

    for mut pod in pods.into_iter().rev() {
        reelay_harness::signal(pod.child.id(), "TERM");
        let exited = tokio::task::spawn_blocking(move || {
            let status = pod.child.wait();
            (pod, status)
        })
        .await
        .unwrap();
        let (pod, status) = exited;
        assert!(status.unwrap().success(), "{} exits cleanly on SIGTERM", pod.name);
    }
}

/// Its write Service's gRPC port is taken by another server first (a race other tests' servers
/// may win between choosing a port and the pod binding it): the write pod starts on fresh ports.
#[tokio::test]
async fn the_local_overlay_runs_as_rendered() {
    run_overlay("local", None, Some(("reelay-write", 50051))).await;
}

#[tokio::test]
async fn the_cluster_overlay_runs_as_rendered() {
    let dir = temp_dir();
    let cluster = NatsServer::start_cluster(dir.path(), 3);
    run_overlay("cluster", Some(&cluster[0]), None).await;
    // The relay created the stream as the overlay asks: 3 replicas.
    let client = async_nats::connect(cluster[0].url()).await.unwrap();
    let mut stream = async_nats::jetstream::new(client).get_stream("REELAY_EVENTS").await.unwrap();
    let info = stream.info().await.unwrap();
    assert_eq!(info.config.num_replicas, 3);
    assert!(info.state.messages >= 2, "the user's and the review's events are in the stream");
}
