"""minisign's key and signature files (Ed25519), written and read with `cryptography`.

Why minisign's format rather than our own: an operator, a hospital's security team or a regulator can check an
edgekit signature with Debian's `minisign` package, and edgekit takes keys and signatures that `minisign` made,
with no edgekit code in the loop. The format (minisign 0.11, jedisct1.github.io/minisign):

- public key: `untrusted comment: ...` then base64(`Ed` + key id (8 bytes) + Ed25519 public key (32));
- secret key: base64(`Ed` + KDF (`Sc` scrypt, or two zero bytes for an unencrypted `minisign -G -W` key) + `B2`
  + salt (32) + opslimit (8, LE) + memlimit (8, LE) + [key id (8) + secret key (64) + BLAKE2b-256 checksum (32)],
  the bracket XORed with the scrypt stream when encrypted);
- signature: `untrusted comment: ...`, base64(`ED` + key id + Ed25519 over BLAKE2b-512 of the file) (`Ed`: over
  the file itself, minisign's legacy mode, verified but never written), `trusted comment: ...`, and base64 of the
  global signature: Ed25519 over the signature bytes followed by the trusted comment, so the comment is signed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from edgekit.errors import EdgekitError

ED, ED_HASHED = b"Ed", b"ED"
KDF_NONE, KDF_SCRYPT, CHECKSUM_B2 = b"\0\0", b"Sc", b"B2"
UNTRUSTED, TRUSTED = "untrusted comment: ", "trusted comment: "


class SignatureError(EdgekitError):
    """A key or signature that is malformed, does not verify, or comes from a key that is not trusted."""

    code = "bad_signature"
    http_status = 422


def _b64(line: str, what: str, path: str | Path | None) -> bytes:
    try:
        return base64.b64decode(line.strip(), validate=True)
    except ValueError:
        raise SignatureError(f"not a minisign {what}: its second line is not base64", path) from None


def _lines(text: str, count: int, what: str, path: str | Path | None) -> list[str]:
    lines = text.splitlines()
    if len(lines) < count or not lines[0].startswith(UNTRUSTED):
        raise SignatureError(f"not a minisign {what} (expected '{UNTRUSTED.strip()}' and {count} lines)", path)
    return lines


def key_id_hex(key_id: bytes) -> str:
    """The key id as minisign prints it: the 8 bytes as a little-endian number, in upper-case hex."""
    return f"{int.from_bytes(key_id, 'little'):016X}"


@dataclass(frozen=True)
class PublicKey:
    key_id: bytes
    key: bytes  # 32 bytes of Ed25519

    @property
    def id_hex(self) -> str:
        return key_id_hex(self.key_id)

    def to_base64(self) -> str:
        return base64.b64encode(ED + self.key_id + self.key).decode()

    def to_text(self) -> str:
        return f"{UNTRUSTED}minisign public key {self.id_hex}\n{self.to_base64()}\n"

    @classmethod
    def from_base64(cls, line: str, path: str | Path | None = None) -> PublicKey:
        raw = _b64(line, "public key", path)
        if len(raw) != 42 or raw[:2] != ED:
            raise SignatureError("not a minisign Ed25519 public key (42 bytes starting 'Ed')", path)
        return cls(raw[2:10], raw[10:])

    @classmethod
    def read(cls, path: str | Path) -> PublicKey:
        """A `.pub` file as `minisign -G` writes it."""
        return cls.from_base64(_lines(_read(path), 2, "public key", path)[1], path)


@dataclass(frozen=True)
class SecretKey:
    key_id: bytes
    seed: bytes  # the Ed25519 private key's 32-byte seed

    def public(self) -> PublicKey:
        pk = Ed25519PrivateKey.from_private_bytes(self.seed).public_key()
        return PublicKey(self.key_id, pk.public_bytes(Encoding.Raw, PublicFormat.Raw))

    def to_text(self) -> str:
        """An unencrypted secret key file (`minisign -G -W`'s form); protect it as any private key file."""
        sk = self.seed + self.public().key
        keynum = self.key_id + sk + hashlib.blake2b(ED + self.key_id + sk, digest_size=32).digest()
        raw = ED + KDF_NONE + CHECKSUM_B2 + bytes(32) + bytes(8) + bytes(8) + keynum
        return f"{UNTRUSTED}minisign secret key (unencrypted)\n{base64.b64encode(raw).decode()}\n"

    @classmethod
    def generate(cls) -> SecretKey:
        return cls(secrets.token_bytes(8), secrets.token_bytes(32))

    @classmethod
    def read(cls, path: str | Path, password: str | None = None) -> SecretKey:
        """A secret key file as `minisign -G` writes it: encrypted with scrypt (then `password` is needed) or not."""
        raw = _b64(_lines(_read(path), 2, "secret key", path)[1], "secret key", path)
        if len(raw) != 158 or raw[:2] != ED or raw[4:6] != CHECKSUM_B2:
            raise SignatureError("not a minisign Ed25519 secret key (158 bytes: 'Ed', KDF, 'B2')", path)
        kdf, salt, keynum = raw[2:4], raw[6:38], raw[54:]
        if kdf == KDF_SCRYPT:
            if password is None:
                raise SignatureError("the secret key is encrypted: give its password", path)
            ops, mem = int.from_bytes(raw[38:46], "little"), int.from_bytes(raw[46:54], "little")
            stream = _scrypt(password.encode(), salt, ops, mem)
            keynum = bytes(a ^ b for a, b in zip(keynum, stream, strict=True))
        elif kdf != KDF_NONE:
            raise SignatureError(f"unknown key derivation {kdf!r} in the secret key", path)
        key_id, sk, checksum = keynum[:8], keynum[8:72], keynum[72:]
        # minisign 0.11 leaves an unencrypted key's checksum zero; the seed must give the key's public half anyway
        unchecked = kdf == KDF_NONE and checksum == bytes(32)
        if not unchecked and not hmac.compare_digest(
            hashlib.blake2b(ED + key_id + sk, digest_size=32).digest(), checksum
        ):
            why = "wrong password" if kdf == KDF_SCRYPT else "checksum mismatch"
            raise SignatureError(f"cannot open the secret key ({why})", path)
        key = cls(key_id, sk[:32])
        if key.public().key != sk[32:]:
            raise SignatureError("cannot open the secret key (its public half does not match its seed)", path)
        return key


def _scrypt(password: bytes, salt: bytes, opslimit: int, memlimit: int) -> bytes:
    """libsodium's crypto_pwhash_scryptsalsa208sha256 (what minisign encrypts keys with): its opslimit and memlimit
    turned into scrypt's N, r, p as libsodium's `pickparams` does, then 104 bytes of key stream."""
    opslimit, r = max(opslimit, 32768), 8
    if opslimit < memlimit // 32:
        p, max_n = 1, opslimit // (r * 4)
        n_log2 = next(i for i in range(1, 63) if (1 << i) > max_n // 2)
    else:
        max_n = memlimit // (r * 128)
        n_log2 = next(i for i in range(1, 63) if (1 << i) > max_n // 2)
        p = max(min((opslimit // 4) // (1 << n_log2), 0x3FFFFFFF) // r, 1)
    n = 1 << n_log2
    return hashlib.scrypt(
        password, salt=salt, n=n, r=r, p=p, maxmem=min(129 * r * n * p + (1 << 24), 2**31 - 1), dklen=104
    )


@dataclass(frozen=True)
class Signature:
    key_id: bytes
    signature: bytes
    trusted_comment: str
    global_signature: bytes
    hashed: bool = True
    untrusted_comment: str = "signature from edgekit"

    def to_text(self) -> str:
        sig = base64.b64encode((ED_HASHED if self.hashed else ED) + self.key_id + self.signature).decode()
        glob = base64.b64encode(self.global_signature).decode()
        return f"{UNTRUSTED}{self.untrusted_comment}\n{sig}\n{TRUSTED}{self.trusted_comment}\n{glob}\n"

    @classmethod
    def parse(cls, text: str, path: str | Path | None = None) -> Signature:
        lines = _lines(text, 4, "signature", path)
        raw = _b64(lines[1], "signature", path)
        if len(raw) != 74 or raw[:2] not in (ED, ED_HASHED):
            raise SignatureError("not a minisign Ed25519 signature (74 bytes starting 'Ed' or 'ED')", path)
        if not lines[2].startswith(TRUSTED):
            raise SignatureError(f"the signature's third line is not a '{TRUSTED.strip()}'", path)
        glob = _b64(lines[3], "signature", path)
        if len(glob) != 64:
            raise SignatureError("the global signature is not 64 bytes", path)
        comment = lines[2][len(TRUSTED) :]
        return cls(raw[2:10], raw[10:], comment, glob, raw[:2] == ED_HASHED, lines[0][len(UNTRUSTED) :])


def sign(message: bytes, key: SecretKey, trusted_comment: str) -> Signature:
    """A prehashed (`ED`) signature of `message` with its signed trusted comment (one line)."""
    if "\n" in trusted_comment or "\r" in trusted_comment:
        raise SignatureError("a trusted comment is one line")
    private = Ed25519PrivateKey.from_private_bytes(key.seed)
    sig = private.sign(hashlib.blake2b(message).digest())
    return Signature(key.key_id, sig, trusted_comment, private.sign(sig + trusted_comment.encode()))


def verify(message: bytes, signature: Signature, keys: list[PublicKey], path: str | Path | None = None) -> PublicKey:
    """The trusted key that made `signature` over `message` (and its trusted comment), else SignatureError."""
    key = next((k for k in keys if k.key_id == signature.key_id), None)
    if key is None:
        trusted = ", ".join(k.id_hex for k in keys) or "none"
        raise SignatureError(
            f"signed by key {key_id_hex(signature.key_id)}, which is not trusted (trusted: {trusted})",
            path,
            code="untrusted_key",
        )
    public = Ed25519PublicKey.from_public_bytes(key.key)
    signed = hashlib.blake2b(message).digest() if signature.hashed else message
    try:
        public.verify(signature.signature, signed)
    except InvalidSignature:
        raise SignatureError(f"the signature does not verify with key {key.id_hex}: the file changed", path) from None
    try:
        public.verify(signature.global_signature, signature.signature + signature.trusted_comment.encode())
    except InvalidSignature:
        raise SignatureError("the trusted comment's signature does not verify: the comment changed", path) from None
    return key


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise SignatureError("no such file", path) from None
    except (OSError, UnicodeDecodeError) as err:
        raise SignatureError(f"cannot read ({type(err).__name__})", path) from None
