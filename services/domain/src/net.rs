//! Network addresses: which are of the public internet. Outgoing requests whose target a
//! remote party chooses (a signer's key, a poster's URL) reach only those, so they cannot be
//! turned against this network's own services (cloud metadata, admin ports).

use std::net::{IpAddr, SocketAddr};

/// A host refused as not public: an IP literal, or a name that resolved to no public address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0} has no public address")]
pub struct NotPublic(pub String);

/// The addresses `name` resolved to that are public; [`NotPublic`] when it resolved to some and
/// none is (none at all is left to the caller's "not found").
pub fn public_only(name: &str, found: Vec<SocketAddr>) -> Result<Vec<SocketAddr>, NotPublic> {
    let any = !found.is_empty();
    let kept: Vec<SocketAddr> = found.into_iter().filter(|addr| is_public(addr.ip())).collect();
    if any && kept.is_empty() {
        return Err(NotPublic(name.to_owned()));
    }
    Ok(kept)
}

/// The address of a URL host (`host_str`, IPv6 in brackets) that is an IP literal and not
/// public.
pub fn private_literal(host: &str) -> Option<IpAddr> {
    host.trim_start_matches('[').trim_end_matches(']').parse().ok().filter(|ip| !is_public(*ip))
}

/// The host of a [`NotPublic`] somewhere in `error`'s chain of sources (a client's error wraps
/// its resolver's), if that is why it failed.
pub fn not_public_in(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut source = Some(error);
    while let Some(error) = source {
        if let Some(NotPublic(host)) = error.downcast_ref::<NotPublic>() {
            return Some(host.clone());
        }
        source = error.source();
    }
    None
}

/// Whether `ip` is an address of the public internet: not loopback, unspecified, private,
/// link-local, shared (carrier NAT), multicast, broadcast, documentation, benchmarking or
/// reserved; an IPv4 address inside IPv6 (mapped, compatible, NAT64, 6to4) as that address, and
/// Teredo and site-local addresses not at all.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, c, _] = v4.octets();
            !(v4.is_unspecified()
                || v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.is_documentation()
                || a == 0
                || a >= 240
                || (a == 100 && (64..128).contains(&b))
                || (a == 192 && b == 0 && c == 0)
                || (a == 198 && (b == 18 || b == 19)))
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let s = v6.segments();
            if s[..6] == [0, 0, 0, 0, 0, 0] || s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                // IPv4-compatible (::a.b.c.d, ::1 among them) or NAT64 (64:ff9b::a.b.c.d).
                let v4 = std::net::Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
                return is_public(IpAddr::V4(v4));
            }
            if s[0] == 0x2002 {
                // 6to4: the IPv4 address its tunnel relays to follows the prefix.
                let v4 = std::net::Ipv4Addr::new((s[1] >> 8) as u8, s[1] as u8, (s[2] >> 8) as u8, s[2] as u8);
                return is_public(IpAddr::V4(v4));
            }
            !(v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                // Site-local (deprecated, still routed inside some networks).
                || (s[0] & 0xffc0) == 0xfec0
                // Documentation, and Teredo (its server and client addresses are IPv4 inside).
                || (s[0] == 0x2001 && (s[1] == 0x0db8 || s[1] == 0)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_keep_their_public_addresses_and_literals_are_told() {
        let addr = |s: &str| -> SocketAddr { s.parse().unwrap() };
        assert_eq!(public_only("a", vec![addr("127.0.0.1:0"), addr("1.1.1.1:0")]), Ok(vec![addr("1.1.1.1:0")]));
        assert_eq!(public_only("a", vec![addr("10.0.0.1:0")]), Err(NotPublic("a".into())));
        assert_eq!(public_only("a", vec![]), Ok(vec![]));
        assert_eq!(private_literal("[::1]"), Some("::1".parse().unwrap()));
        assert_eq!(private_literal("169.254.169.254"), Some("169.254.169.254".parse().unwrap()));
        assert_eq!(private_literal("1.1.1.1"), None);
        assert_eq!(private_literal("image.tmdb.org"), None);
        #[derive(Debug, thiserror::Error)]
        #[error("the request failed")]
        struct Client(#[source] NotPublic);
        assert_eq!(not_public_in(&Client(NotPublic("h".into()))), Some("h".into()));
        assert_eq!(not_public_in(&std::io::Error::other("refused")), None);
    }

    #[test]
    fn public_addresses() {
        for public in
            ["1.1.1.1", "93.184.215.14", "2606:4700::1111", "::ffff:1.1.1.1", "64:ff9b::101:101", "2002:101:101::1"]
        {
            assert!(is_public(public.parse().unwrap()), "{public}");
        }
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "192.0.2.1",
            "198.18.0.1",
            "240.0.0.1",
            "::1",
            "::",
            "2002:7f00:1::1",
            "2002:a00:1::",
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
            "fec0::1",
            "fd00::1",
            "fe80::1",
            "ff02::1",
            "2001:db8::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "::127.0.0.1",
            "64:ff9b::a00:1",
        ] {
            assert!(!is_public(private.parse().unwrap()), "{private}");
        }
    }
}
