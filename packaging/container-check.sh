#!/usr/bin/env bash
# Builds the container image and runs the cluster in packaging/compose.yaml, end to end:
#   1. the static (musl) `tessera` binary, release build;
#   2. the image from packaging/Containerfile (FROM scratch: no base image is pulled);
#   3. `tessera serve` alone on the same model, with that binary, for the reference answer;
#   4. compose.yaml under podman-compose: a head and two nodes, joined with no hand copy;
#   5. one greedy chat completion from each, which must be the same text;
#   6. everything it made removed: containers, network, volumes, image, files.
# Exits non-zero on the first failure, with the head's and nodes' logs when the cluster is at
# fault. Run from anywhere: `packaging/container-check.sh` (root, for rootful podman).
# `--install` (or CI=true) first installs what it needs with apt-get and rustup.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
target=x86_64-unknown-linux-musl
model=stories260K.gguf
max_tokens=40
say() { printf 'container-check: %s\n' "$*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

if [[ ${1:-} == --install || ${CI:-} == true ]]; then
    say "installing podman, podman-compose, runc, musl-tools and the $target target"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq podman podman-compose runc musl-tools curl python3 >/dev/null
    rustup target add "$target" >/dev/null
fi
for tool in podman podman-compose cargo curl python3; do
    command -v "$tool" >/dev/null || fail "$tool is not installed (rerun with --install)"
done

work=$(mktemp -d /tmp/tessera-container-check.XXXXXX)
project="tessera-check-$$"
image="localhost/tessera-check-$$:latest"
reference_pid=
# podman-compose on this run's project, with the settings in $work/compose.env (step 4).
compose() {
    (set -a
     # shellcheck source=/dev/null
     . "$work/compose.env"
     set +a
     podman-compose -p "$project" -f "$root/packaging/compose.yaml" "$@")
}
cleanup() {
    local rc=$?
    set +e
    [[ -n $reference_pid ]] && kill "$reference_pid" 2>/dev/null && wait "$reference_pid"
    if [[ -f $work/compose.env ]]; then
        compose down -v -t 15 >"$work/down.log" 2>&1 \
            || { say "compose down failed:"; cat "$work/down.log" >&2; }
    fi
    # Whatever compose down left (podman-compose 1.0 leaves the network), by project label.
    local label="label=io.podman.compose.project=$project" left
    podman ps -aq --filter "$label" | xargs -r podman rm -f -t 0 >/dev/null
    podman volume ls -q --filter "$label" | xargs -r podman volume rm -f >/dev/null
    podman network ls -q --filter "$label" | xargs -r podman network rm -f >/dev/null
    podman image exists "$image" && podman rmi -f "$image" >/dev/null
    left=$(podman ps -aq --filter "$label"; podman volume ls -q --filter "$label";
           podman network ls -q --filter "$label"; podman image exists "$image" && echo "$image")
    rm -rf "$work"
    if [[ -n $left ]]; then
        say "FAILED: left behind: $left"
        rc=1
    fi
    exit "$rc"
}
trap cleanup EXIT

# Podman's settings for this run only, in a file of our own (CONTAINERS_CONF):
# - rootful podman raises each container's open-file and process limits to 1048576, which
#   needs CAP_SYS_RESOURCE; sandboxed hosts drop it (crun/runc: "setrlimit RLIMIT_NOFILE:
#   Operation not permitted"), so the containers get limits podman already has: this
#   shell's, and for processes at most 32768, where podman 4.3 lowers its own limit;
# - crun refuses hosts whose cgroups are hybrid, v1 with controllers left on the v2 mount
#   ("cgroups in hybrid mode not supported"); runc runs there.
nofile=$(ulimit -Hn) nproc=$(ulimit -Hu)
[[ $nofile == unlimited || $nofile -gt 1048576 ]] && nofile=1048576
[[ $nproc == unlimited || $nproc -gt 32768 ]] && nproc=32768
{
    echo '[containers]'
    echo "default_ulimits = [\"nofile=$nofile:$nofile\", \"nproc=$nproc:$nproc\"]"
    if grep -qs . /sys/fs/cgroup/unified/cgroup.controllers; then
        command -v runc >/dev/null || fail "hybrid cgroups need runc (crun refuses them)"
        say "hybrid cgroups ($(tr '\n' ' ' </sys/fs/cgroup/unified/cgroup.controllers)on v2): runc"
        printf '[engine]\nruntime = "runc"\n'
    fi
} >"$work/containers.conf"
export CONTAINERS_CONF=$work/containers.conf

say "1. the static binary: cargo build --release --locked --target $target -p tessera"
(cd "$root" && cargo build --release --locked --target "$target" -p tessera)
bin=${CARGO_TARGET_DIR:-$root/target}/$target/release/tessera
[[ -x $bin ]] || fail "no binary at $bin"
if command -v readelf >/dev/null && readelf -l "$bin" | grep -q INTERP; then
    fail "$bin asks for a dynamic loader: it would not run on an empty base"
fi

say "2. the image: podman build -f packaging/Containerfile -t $image"
mkdir "$work/image"
cp "$bin" "$work/image/tessera"
podman build -q -f "$root/packaging/Containerfile" -t "$image" "$work/image" >/dev/null
user=$(podman image inspect "$image" --format '{{.Config.User}}')
[[ $user == 10001:10001 ]] || fail "the image runs as '$user', not 10001:10001"
podman run --rm "$image" --version >"$work/version" || fail "the image does not run"
say "   $(cat "$work/version"), as $user"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
key="check-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
printf 'check %s\n' "$key" >"$work/api-keys"
chmod 0644 "$work/api-keys" # read by uid 10001 in the head; $work itself is 0700

# POSTs one greedy chat completion to port $1 until it is answered (a cluster answers 503
# until its nodes have loaded their layers) or $2 seconds pass; the body goes to $3.
ask() {
    local port=$1 limit=$2 out=$3 code deadline=$((SECONDS + $2))
    local body='{"model":"stories260K","messages":[{"role":"user","content":"Once upon a time"}],"max_tokens":'$max_tokens',"temperature":0}'
    while ((SECONDS < deadline)); do
        code=$(curl -s -o "$out" -w '%{http_code}' -m 60 "http://127.0.0.1:$port/v1/chat/completions" \
            -H "authorization: Bearer $key" -H 'content-type: application/json' -d "$body") || code=000
        [[ $code == 200 ]] && return 0
        sleep 1
    done
    say "no answer from port $port within ${limit}s (last status $code): $(cat "$out" 2>/dev/null)"
    return 1
}
text_of() { python3 -c 'import json,sys; c=json.load(open(sys.argv[1]))["choices"][0]; print(json.dumps([c["message"]["content"], c["finish_reason"]]))' "$1"; }

say "3. the reference: tessera serve --model models/$model (this binary, one process)"
ref_port=$(free_port)
"$bin" serve --model "$root/models/$model" --listen "127.0.0.1:$ref_port" \
    --api-key-file "$work/api-keys" >"$work/reference.log" 2>&1 &
reference_pid=$!
ask "$ref_port" 60 "$work/reference.json" || { cat "$work/reference.log" >&2; fail "tessera serve did not answer"; }
kill "$reference_pid"; wait "$reference_pid" || true; reference_pid=

say "4. the cluster: podman-compose -f packaging/compose.yaml up -d (project $project)"
api_port=$(free_port)
cat >"$work/compose.env" <<EOF
TESSERA_IMAGE=$image
TESSERA_PUBLISH=127.0.0.1:$api_port
TESSERA_API_KEYS=$work/api-keys
TESSERA_MODELS=$root/models
TESSERA_MODEL=$model
EOF
compose up -d >"$work/up.log" 2>&1 || { cat "$work/up.log" >&2; fail "podman-compose up"; }
if ! ask "$api_port" 300 "$work/cluster.json"; then
    for c in head node-a node-b; do
        say "--- ${project}_${c}_1"; podman logs "${project}_${c}_1" >&2 || true
    done
    fail "the cluster did not answer"
fi
for n in node-a node-b; do
    log=$(podman logs "${project}_${n}_1" 2>&1)
    grep -q "^joined coordinator .* as $n " <<<"$log" || { say "$log"; fail "$n never joined"; }
    say "   $n: $(grep -m1 '^joined' <<<"$log"); $(grep -m1 '^loaded' <<<"$log")"
done

head_log=$(podman logs "${project}_head_1" 2>&1)
grep -q '^serving: every stage is loaded and linked' <<<"$head_log" || { say "$head_log"; fail "the head never served"; }
say "   head: $(grep -m1 '^waiting for' <<<"$head_log" | cut -d: -f1)"

say "5. the same text?"
want=$(text_of "$work/reference.json")
got=$(text_of "$work/cluster.json")
say "   serve alone: $want"
say "   cluster:     $got"
[[ $want == "$got" ]] || fail "the cluster's answer differs from tessera serve's"
say "6. SIGTERM: podman-compose stop, and every container exits 0"
compose stop -t 15 >"$work/stop.log" 2>&1 || { cat "$work/stop.log" >&2; fail "podman-compose stop"; }
for c in head node-a node-b; do
    code=$(podman inspect "${project}_${c}_1" --format '{{.State.ExitCode}}')
    [[ $code == 0 ]] || { podman logs "${project}_${c}_1" >&2; fail "$c exited with $code on SIGTERM"; }
done

say "OK: the image built, the compose cluster (head + 2 nodes) answered as tessera serve does"
