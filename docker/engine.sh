#!/usr/bin/env bash
# Makes a Docker engine answer on this machine, for `make compose-test` and the compose test in
# CI (tests/deploy/test_compose_up.py). Exit 0: `docker info` works. Exit 3: no engine can start
# here, with the reason as the last line of stderr (the test then skips, saying why). The engine
# this script started keeps running; docker/engine.sh stop ends it (and only it).
#
# Where dockerd is missing and we are root with apt-get, it installs Debian's docker.io and
# mmdebstrap (for docker/base-image.sh) first; TANDEM_DOCKER_INSTALL=0 turns that off.
# dockerd runs with --iptables=false: a machine without netfilter rights can still run it, and
# containers then reach nothing outside (the images are built with the host's network).
set -uo pipefail

STATE=${TANDEM_DOCKER_STATE:-/tmp/tandem-dockerd}
mkdir -p "$STATE"
no() { echo "no Docker engine: $*" >&2; exit 3; }

if [[ ${1:-} == stop ]]; then
    [[ -f $STATE/pid ]] || exit 0
    pid=$(cat "$STATE/pid")
    kill "$pid" 2>/dev/null && while kill -0 "$pid" 2>/dev/null; do sleep 0.5; done
    rm -f "$STATE/pid"
    exit 0
fi

if answer=$(docker info 2>&1 >/dev/null); then
    exit 0
fi
answer=$(echo "$answer" | grep -m1 . | cut -c1-200)
if ! command -v dockerd >/dev/null; then
    if [[ $(id -u) != 0 || ${TANDEM_DOCKER_INSTALL:-1} == 0 ]] || ! command -v apt-get >/dev/null
    then
        no "dockerd is not installed (apt-get install docker.io as root)"
    fi
    echo "installing docker.io and mmdebstrap with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -q && apt-get install -y -q --no-install-recommends docker.io mmdebstrap \
        ca-certificates; } >"$STATE/apt.log" 2>&1 ||
        no "apt-get install docker.io failed (see $STATE/apt.log)"
fi
command -v docker >/dev/null || no "no docker client"
[[ $(id -u) == 0 ]] || no "docker info: ${answer:-no answer}; starting dockerd needs root"
# A socket left by an engine that died would make dockerd refuse to start.
[[ -f $STATE/pid ]] && ! kill -0 "$(cat "$STATE/pid")" 2>/dev/null && rm -f "$STATE/pid"
if [[ ! -f $STATE/pid ]]; then
    setsid dockerd --iptables=false >"$STATE/dockerd.log" 2>&1 </dev/null &
    echo $! >"$STATE/pid"
    echo "started dockerd (pid $!, log $STATE/dockerd.log)" >&2
fi
for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && exit 0
    kill -0 "$(cat "$STATE/pid")" 2>/dev/null || break
    sleep 1
done
reason=$(grep -m1 -iE 'failed to start|error' "$STATE/dockerd.log" | cut -c1-300)
kill "$(cat "$STATE/pid")" 2>/dev/null
rm -f "$STATE/pid"
no "dockerd did not start: ${reason:-no answer in 60 s} (log $STATE/dockerd.log)"
