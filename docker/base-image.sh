#!/usr/bin/env bash
# Makes the base image of docker/Dockerfile.cpu from Debian's packages, without pulling from an
# image registry: mmdebstrap (or debootstrap) installs a minimal Debian with Python 3 and venv,
# and `docker import` turns that root file system into an image. Where a registry is reachable,
# any image with python3 (>= 3.11) and its venv module will do as BASE_IMAGE instead.
#
#   docker/base-image.sh [IMAGE]      # default tandem-base:bookworm; does nothing if it exists
#
# Environment: SUITE (bookworm), MIRROR (http://deb.debian.org/debian), FORCE=1 to rebuild,
# BOOTSTRAP=debootstrap to use it where mmdebstrap is installed too.
# Needs root (the bootstrap chroots) and a running Docker engine.
set -euo pipefail

IMAGE=${1:-tandem-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY=${SECURITY:-${MIRROR%/debian}/debian-security}
# python3-venv brings ensurepip's pip wheel; ca-certificates lets pip reach its index.
PACKAGES=python3,python3-venv,ca-certificates

if [[ ${FORCE:-0} != 1 ]] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base image $IMAGE exists (FORCE=1 rebuilds it)"
    exit 0
fi
if [[ $(id -u) != 0 ]]; then
    echo "base-image.sh: bootstrapping Debian needs root" >&2
    exit 1
fi

# The image is for services, not people: no documentation, manuals or translations, and no
# package lists (a Dockerfile that needs apt runs `apt-get update` first).
lean_hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/usr/share/doc/* '
lean_hook+='"$1"/usr/share/man/* "$1"/usr/share/info/* "$1"/usr/share/locale/*'
# The image trusts the certificate authorities this host added (a TLS proxy in front of the
# package index, for one), and pip uses the system's bundle instead of its own.
trust_hook='cp /usr/local/share/ca-certificates/*.crt "$1"/usr/local/share/ca-certificates/ '
trust_hook+='2>/dev/null; chroot "$1" update-ca-certificates >/dev/null; '
trust_hook+='printf "[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n" > "$1"/etc/pip.conf'
changes=(--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]')
if ! command -v mmdebstrap >/dev/null && ! command -v debootstrap >/dev/null &&
    command -v apt-get >/dev/null; then
    echo "installing mmdebstrap with apt-get" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q mmdebstrap >/dev/null ||
        { apt-get update -q >/dev/null && apt-get install -y -q mmdebstrap >/dev/null; }
fi
BOOTSTRAP=${BOOTSTRAP:-$(command -v mmdebstrap >/dev/null && echo mmdebstrap || echo debootstrap)}
start=$SECONDS
if [[ $BOOTSTRAP == mmdebstrap ]]; then
    mmdebstrap --variant=minbase --include="$PACKAGES" \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --customize-hook="$trust_hook" --customize-hook="$lean_hook" \
        "$SUITE" - \
        "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" \
        "deb $SECURITY $SUITE-security main" |
        docker import "${changes[@]}" - "$IMAGE"
elif command -v "$BOOTSTRAP" >/dev/null; then
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    "$BOOTSTRAP" --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR"
    bash -c "$trust_hook" _ "$root"
    bash -c "$lean_hook" _ "$root"
    tar -C "$root" -c . | docker import "${changes[@]}" - "$IMAGE"
else
    echo "base-image.sh: needs mmdebstrap or debootstrap (apt-get install mmdebstrap)" >&2
    exit 1
fi
docker run --rm "$IMAGE" python3 -c 'import sys, venv; assert sys.version_info >= (3, 11)'
echo "base image $IMAGE built in $((SECONDS - start)) s"
