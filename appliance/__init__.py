"""The core the builder (host) and applianctl (device) share: the configuration model, the
release formats, file hashing, paths, the error type, atomic writes and one subprocess helper.

It ships in the image's /usr beside applianctl, so it uses only the standard library and
Debian's python3-cryptography. Neither builder/ nor applianctl/ imports the other; both import this.
"""
