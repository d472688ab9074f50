package hostnet

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
)

// Bounds on what a guest can make the DNS proxy hold.
const (
	maxQuerySize    = 4096             // bytes of one query, UDP or TCP
	maxInflight     = 64               // queries being answered at once, per sandbox
	maxTCPConns     = 8                // TCP connections at once, per sandbox
	tcpIdle         = 10 * time.Second // a TCP connection's idle limit
	upstreamTimeout = 2 * time.Second  // per upstream server try
	maxLearned      = 4096             // learned addresses, per sandbox
	minLearnTTL     = 30 * time.Second
	maxLearnTTL     = time.Hour
)

// exchanger sends a query upstream and returns the answer.
type exchanger interface {
	exchange(ctx context.Context, q *dns.Msg) (*dns.Msg, error)
}

// learner records addresses the proxy resolved for name under the current
// policy (deny: for a deny list) before the answer goes back to the guest.
type learner func(name string, deny bool, addrs []netip.Addr, ttl time.Duration) error

// proxy is one sandbox's DNS proxy: it answers the guest's queries by its
// egress policy, forwarding allowed ones upstream.
type proxy struct {
	policy atomic.Pointer[Policy] // normalized
	up     exchanger
	learn  learner
	log    *rateLog
	sem    chan struct{}
}

func newProxy(p Policy, up exchanger, learn learner, log *slog.Logger) *proxy {
	px := &proxy{up: up, learn: learn, log: newRateLog(log, time.Second), sem: make(chan struct{}, maxInflight)}
	px.setPolicy(p)
	return px
}

func (px *proxy) setPolicy(p Policy) { px.policy.Store(&p) }

// answer returns the reply to the wire-format query req, at most maxSize
// bytes (UDP; the guest's EDNS size, 512 without), or nil when req gets no
// reply (it is not a query at all).
func (px *proxy) answer(ctx context.Context, req []byte, udp bool) []byte {
	if len(req) < 12 || len(req) > maxQuerySize {
		return nil
	}
	var q dns.Msg
	if err := q.Unpack(req); err != nil {
		if req[2]&0x80 != 0 { // a response: ignore
			return nil
		}
		m := &dns.Msg{MsgHdr: dns.MsgHdr{Id: binary.BigEndian.Uint16(req), Response: true, Rcode: dns.RcodeFormatError}}
		return pack(m, udp, 512)
	}
	if q.Response {
		return nil
	}
	size := 512
	if opt := q.IsEdns0(); opt != nil {
		size = min(max(int(opt.UDPSize()), 512), maxQuerySize)
	}
	reply := func(rcode int) []byte {
		m := new(dns.Msg)
		m.SetRcode(&q, rcode)
		m.RecursionAvailable = true
		return pack(m, udp, size)
	}
	if q.Opcode != dns.OpcodeQuery {
		return reply(dns.RcodeNotImplemented)
	}
	if len(q.Question) != 1 {
		return reply(dns.RcodeFormatError)
	}
	qq := q.Question[0]
	if qq.Qclass != dns.ClassINET {
		return reply(dns.RcodeRefused)
	}
	name := canonicalName(qq.Name)
	pol := px.policy.Load()
	switch pol.Mode {
	case DenyAll:
		return reply(dns.RcodeRefused)
	case AllowList:
		if !pol.matchName(name) {
			return reply(dns.RcodeRefused)
		}
	case DenyList:
		if pol.matchName(name) {
			px.denyResolve(ctx, name)
			return reply(dns.RcodeNameError)
		}
	}
	if qq.Qtype == dns.TypeAAAA {
		// Sandboxes have no IPv6: no records, so the guest goes to IPv4.
		return reply(dns.RcodeSuccess)
	}
	out := new(dns.Msg)
	out.SetQuestion(qq.Name, qq.Qtype)
	out.RecursionDesired = q.RecursionDesired
	out.SetEdns0(1232, false)
	resp, err := px.up.exchange(ctx, out)
	if err != nil {
		px.log.Warn("dns proxy: upstream failed", "name", name, "err", err)
		return reply(dns.RcodeServerFailure)
	}
	if pol.Mode == AllowList {
		addrs, ttl := answerAddrs(resp)
		if len(addrs) > 0 {
			if err := px.learn(name, false, addrs, ttl); err != nil {
				px.log.Warn("dns proxy: learning addresses failed", "name", name, "err", err)
				return reply(dns.RcodeServerFailure)
			}
		}
	}
	m := new(dns.Msg)
	m.SetReply(&q)
	m.Rcode = resp.Rcode
	m.RecursionAvailable = resp.RecursionAvailable
	m.AuthenticatedData = false
	m.Answer = resp.Answer
	m.Ns = resp.Ns
	for _, rr := range resp.Extra {
		if _, ok := rr.(*dns.OPT); !ok {
			m.Extra = append(m.Extra, rr)
		}
	}
	if q.IsEdns0() != nil {
		m.SetEdns0(uint16(size), false)
	}
	return pack(m, udp, size)
}

// denyResolve resolves a denied name from kilnd (best effort, in the
// background, bounded by the proxy's in-flight limit) and adds its
// addresses to the deny set, so the guest cannot reach them by address
// from another resolver either.
func (px *proxy) denyResolve(ctx context.Context, name string) {
	select {
	case px.sem <- struct{}{}:
	default:
		return
	}
	go func() {
		defer func() { <-px.sem }()
		ctx, cancel := context.WithTimeout(ctx, 2*upstreamTimeout)
		defer cancel()
		out := new(dns.Msg)
		out.SetQuestion(dns.Fqdn(name), dns.TypeA)
		resp, err := px.up.exchange(ctx, out)
		if err != nil {
			return
		}
		if addrs, ttl := answerAddrs(resp); len(addrs) > 0 {
			if err := px.learn(name, true, addrs, ttl); err != nil {
				px.log.Warn("dns proxy: adding denied addresses failed", "name", name, "err", err)
			}
		}
	}()
}

// answerAddrs returns the IPv4 addresses in resp's answer section (the
// records of the name and of its CNAME chain) and their least TTL.
func answerAddrs(resp *dns.Msg) ([]netip.Addr, time.Duration) {
	var addrs []netip.Addr
	ttl := maxLearnTTL
	for _, rr := range resp.Answer {
		a, ok := rr.(*dns.A)
		if !ok {
			continue
		}
		addr, ok := netip.AddrFromSlice(a.A.To4())
		if !ok {
			continue
		}
		addrs = append(addrs, addr)
		ttl = min(ttl, time.Duration(a.Hdr.Ttl)*time.Second)
	}
	return addrs, min(max(ttl, minLearnTTL), maxLearnTTL)
}

// pack encodes m; over UDP it is truncated to size.
func pack(m *dns.Msg, udp bool, size int) []byte {
	m.Compress = true
	if udp {
		m.Truncate(size)
	}
	b, err := m.Pack()
	if err != nil {
		// A reply without records still tells the guest something.
		m.Answer, m.Ns, m.Extra = nil, nil, nil
		m.Rcode = dns.RcodeServerFailure
		if b, err = m.Pack(); err != nil {
			return nil
		}
	}
	return b
}

// serveUDP answers queries on pc until it is closed.
func (px *proxy) serveUDP(ctx context.Context, pc net.PacketConn, wg *sync.WaitGroup) {
	buf := make([]byte, maxQuerySize+1)
	for {
		n, addr, err := pc.ReadFrom(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) || ctx.Err() != nil {
				return
			}
			px.log.Warn("dns proxy: udp read", "err", err)
			continue
		}
		if n > maxQuerySize {
			continue
		}
		select {
		case px.sem <- struct{}{}:
		default:
			px.log.Warn("dns proxy: too many queries in flight, dropping one", "limit", maxInflight)
			continue
		}
		req := append([]byte(nil), buf[:n]...)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-px.sem }()
			if resp := px.answer(ctx, req, true); resp != nil {
				pc.WriteTo(resp, addr)
			}
		}()
	}
}

// serveTCP answers queries on l's connections until l is closed.
func (px *proxy) serveTCP(ctx context.Context, l net.Listener, wg *sync.WaitGroup) {
	conns := make(chan struct{}, maxTCPConns)
	var mu sync.Mutex
	open := map[net.Conn]bool{}
	defer func() {
		mu.Lock()
		for c := range open {
			c.Close()
		}
		mu.Unlock()
	}()
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || ctx.Err() != nil {
				return
			}
			px.log.Warn("dns proxy: tcp accept", "err", err)
			select {
			case <-time.After(100 * time.Millisecond):
			case <-ctx.Done():
				return
			}
			continue
		}
		select {
		case conns <- struct{}{}:
		default:
			px.log.Warn("dns proxy: too many tcp connections, closing one", "limit", maxTCPConns)
			c.Close()
			continue
		}
		mu.Lock()
		open[c] = true
		mu.Unlock()
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-conns }()
			px.serveConn(ctx, c)
			mu.Lock()
			delete(open, c)
			mu.Unlock()
			c.Close()
		}()
	}
}

// serveConn answers length-prefixed queries on one TCP connection.
func (px *proxy) serveConn(ctx context.Context, c net.Conn) {
	var hdr [2]byte
	buf := make([]byte, maxQuerySize)
	for ctx.Err() == nil {
		c.SetDeadline(time.Now().Add(tcpIdle))
		if _, err := readFull(c, hdr[:]); err != nil {
			return
		}
		n := int(binary.BigEndian.Uint16(hdr[:]))
		if n > maxQuerySize {
			return
		}
		if _, err := readFull(c, buf[:n]); err != nil {
			return
		}
		px.sem <- struct{}{}
		resp := px.answer(ctx, buf[:n], false)
		<-px.sem
		if resp == nil {
			continue
		}
		out := make([]byte, 2+len(resp))
		binary.BigEndian.PutUint16(out, uint16(len(resp)))
		copy(out[2:], resp)
		if _, err := c.Write(out); err != nil {
			return
		}
	}
}

func readFull(c net.Conn, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		m, err := c.Read(b[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// forwarder asks upstream servers, over UDP and, for a truncated answer,
// TCP, through dial (which makes its sockets in the host netns).
type forwarder struct {
	servers []netip.AddrPort
	dial    func(ctx context.Context, network, addr string) (net.Conn, error)
}

func (f *forwarder) exchange(ctx context.Context, q *dns.Msg) (*dns.Msg, error) {
	var errs []error
	for _, s := range f.servers {
		r, err := f.try(ctx, "udp", s, q)
		if err == nil && r.Truncated {
			r, err = f.try(ctx, "tcp", s, q)
		}
		if err == nil {
			return r, nil
		}
		errs = append(errs, fmt.Errorf("%v: %w", s, err))
		if ctx.Err() != nil {
			break
		}
	}
	if len(errs) == 0 {
		return nil, errors.New("no upstream DNS servers")
	}
	return nil, errors.Join(errs...)
}

func (f *forwarder) try(ctx context.Context, network string, s netip.AddrPort, q *dns.Msg) (*dns.Msg, error) {
	ctx, cancel := context.WithTimeout(ctx, upstreamTimeout)
	defer cancel()
	conn, err := f.dial(ctx, network, s.String())
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	c := &dns.Client{Net: network, Timeout: upstreamTimeout}
	r, _, err := c.ExchangeWithConnContext(ctx, q, &dns.Conn{Conn: conn, UDPSize: 1232})
	return r, err
}

// rateLog logs at most one line per interval, counting what it drops: a
// guest can trigger these lines.
type rateLog struct {
	log      *slog.Logger
	every    time.Duration
	mu       sync.Mutex
	last     time.Time
	dropped  int
}

func newRateLog(log *slog.Logger, every time.Duration) *rateLog {
	return &rateLog{log: log, every: every}
}

func (r *rateLog) Warn(msg string, args ...any) {
	r.mu.Lock()
	now := time.Now()
	if now.Sub(r.last) < r.every {
		r.dropped++
		r.mu.Unlock()
		return
	}
	r.last = now
	dropped := r.dropped
	r.dropped = 0
	r.mu.Unlock()
	if dropped > 0 {
		args = append(args, "suppressed", dropped)
	}
	r.log.Warn(msg, args...)
}
