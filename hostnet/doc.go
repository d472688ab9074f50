// Package hostnet gives each sandbox its own network on the host: a
// network namespace with a tap for the VMM, an address block from a pool,
// NAT out of the host's uplink, an egress policy enforced with nftables and
// a DNS proxy that makes domain rules hold when addresses change.
//
// # Topology
//
// For a sandbox with pool block n (a /29 of Config.Pool at offset 8n):
//
//	host netns                         sandbox netns (pinned at Dir/netns/<id>)
//	uplink ── kiln<n> .1/30 ══ veth ══ veth0 .2/30
//	                                    tap0  .5/30 ── VMM ── guest eth0 .6/30
//
// The host netns routes the guest's /30 (.4/30) via veth0's address; the
// sandbox netns's default route is the host end (.1). The tap is
// persistent, made with IFF_TAP|IFF_NO_PI|IFF_VNET_HDR, the flags the VMM
// opens it with (virtio's openTap, inside Info.Netns). The guest gets
// Info.Address (.6/30), its default route and nameserver Info.Gateway (.5)
// and a fresh random locally administered MAC. IPv6 is disabled in the
// sandbox netns and dropped from the guest: sandboxes are IPv4 only, so a
// Policy takes IPv4 prefixes only and the proxy answers AAAA queries with
// no records.
//
// # Host side
//
// New turns on IPv4 forwarding in the host netns and installs kiln's own
// table "ip kiln" there (replaced atomically; other tables are not touched):
// masquerade of the pool out of the uplink; forward accept from the kiln*
// veths, drop between two of them and from a source outside the pool, and
// no new connections into them; connections from a veth to the host's own
// addresses are refused. Another
// table's drop still wins over kiln's accept (nftables runs every base
// chain of a hook), so a host firewall must let the pool's traffic forward.
// Interface names starting with "kiln" in the host netns are kiln's.
//
// # Egress policy
//
// Each sandbox netns has its own table "inet kiln". Its forward chain
// (policy drop) first drops from tap0 anything that is not IPv4 from the
// guest's own address (anti-spoofing; tap0 also has rp_filter=1), accepts
// established and related traffic, rejects (TCP reset, else ICMP
// admin-prohibited, so a connect fails at once) anything from tap0 to the
// pool (other sandboxes, the veths), and in the list modes DNS (53) and
// DNS over TLS or QUIC (853) to anything but the gateway, then by mode:
// AllowAll accepts; DenyAll rejects; AllowList accepts only destinations
// in the set allow_dns or in CIDRs; DenyList rejects destinations in CIDRs
// or in the set deny_dns and accepts the rest. In every mode the refused
// destinations (Config.Refused, DefaultRefused: link-local with the cloud
// metadata service, loopback, RFC 1918, CGNAT and the other special-purpose
// ranges; the interval set "refused") are rejected unless an allow list
// names them: a CIDR inside a refused range (not one that merely contains
// it, as 0.0.0.0/0 does), or a domain the proxy resolves there. Nothing
// from outside opens a connection to the guest. The input chain (policy
// drop) accepts from tap0 only DNS (UDP and TCP) to the gateway and
// rejects the rest: the guest reaches no service of its netns or of the
// host. The output chain (policy drop) accepts only replies and loopback:
// nothing in the netns (a jailed VMM process a guest escaped into) opens a
// connection. SetPolicy replaces the table in one nftables transaction and
// then deletes the conntrack entries of the guest's connections that the
// new policy forbids, so established connections are cut too (their next
// packet is judged as new).
//
// # DNS proxy
//
// Per sandbox, UDP and TCP sockets on gateway:53 made inside the sandbox
// netns; queries go upstream (Config.DNS, or /etc/resolv.conf's
// nameservers) from sockets made in the host netns. The proxy builds a
// fresh query from the guest's question (one question, class IN, opcode
// QUERY) rather than forwarding the guest's bytes. DenyAll refuses every
// query. AllowList refuses names no domain matches; for a match, the A
// records of the answer (the name's and its CNAME chain's) go into
// allow_dns with a timeout of their least TTL clamped to 30 s .. 1 h before
// the answer goes back, so the guest's first connect is already allowed.
// DenyList answers matching names NXDOMAIN. The manager resolves a deny
// list's names itself into deny_dns, at Attach, Adopt and SetPolicy
// (waiting up to 5 s for the round) and again as each answer's TTL runs
// out (addresses stay for their TTL and 30 s more), so a guest that
// learned an address another way (its own resolver, DNS over HTTPS, a
// literal) is still refused; for "*.example.com" it resolves example.com,
// and names under it are denied when the guest asks for them. Domain
// "example.com" matches only itself; "*.example.com" matches example.com
// and every name under it; names are compared label by label (a query
// label holding an escaped dot is one label). A domain
// rule trusts the domain's DNS: its owner decides which addresses it
// allows. Bounds: 4096-byte queries, 64 queries in flight and 8 TCP
// connections (idle 10 s) per sandbox, 4096 learned addresses per sandbox,
// MaxCIDRs and MaxDomains per policy; what a guest can trigger is logged at
// most once a second per sandbox.
//
// # State and restarts
//
// Dir holds records/<id>.json (block, MAC, policy; written before anything
// is made, so a crash leaves a record that Detach cleans up) and the netns
// pins. A new Manager over the same Dir keeps the recorded blocks taken;
// Adopt reopens an attachment and restarts its proxy (addresses learned
// before the restart stay in the sets until they expire but are not carried
// over by a later SetPolicy); it rewrites the netns's table as this
// manager makes it, with the learned addresses and the time they have
// left. Close stops the proxies and leaves the attachments for the next
// Manager.
//
// # Needs
//
// Linux, root (CAP_NET_ADMIN and CAP_SYS_ADMIN: namespaces, mounts, taps,
// nftables), nf_tables with inet, nat, masquerade, reject and conntrack
// (ctnetlink for cutting connections), veth and /dev/net/tun.
package hostnet
