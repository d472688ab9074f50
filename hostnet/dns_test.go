package hostnet

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// zoneUpstream answers from a fixed zone, as an upstream resolver would.
type zoneUpstream struct {
	mu    sync.Mutex
	asked []string
	fail  bool
}

func (z *zoneUpstream) exchange(ctx context.Context, q *dns.Msg) (*dns.Msg, error) {
	z.mu.Lock()
	z.asked = append(z.asked, q.Question[0].Name)
	fail := z.fail
	z.mu.Unlock()
	if fail {
		return nil, errors.New("upstream down")
	}
	r := new(dns.Msg)
	r.SetReply(q)
	r.RecursionAvailable = true
	name := q.Question[0].Name
	a := func(owner, addr string, ttl uint32) dns.RR {
		return &dns.A{Hdr: dns.RR_Header{Name: owner, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: ttl}, A: net.ParseIP(addr)}
	}
	switch canonicalName(name) {
	case "allowed.test":
		r.Answer = []dns.RR{a(name, "192.0.2.1", 5), a(name, "192.0.2.2", 7200)}
	case "cname.allowed.test":
		r.Answer = []dns.RR{
			&dns.CNAME{Hdr: dns.RR_Header{Name: name, Rrtype: dns.TypeCNAME, Class: dns.ClassINET, Ttl: 300}, Target: "target.elsewhere."},
			a("target.elsewhere.", "192.0.2.9", 300),
		}
	case "denied.test":
		r.Answer = []dns.RR{a(name, "198.51.100.1", 300)}
	default:
		r.Rcode = dns.RcodeNameError
	}
	return r, nil
}

// learnLog records what the proxy learns.
type learnLog struct {
	mu  sync.Mutex
	got []learnCall
	err error
}

type learnCall struct {
	name  string
	deny  bool
	addrs []netip.Addr
	ttl   time.Duration
}

func (l *learnLog) learn(name string, deny bool, addrs []netip.Addr, ttl time.Duration) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.got = append(l.got, learnCall{name, deny, addrs, ttl})
	return l.err
}

func (l *learnLog) calls() []learnCall {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.got)
}

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func query(t testing.TB, name string, qtype uint16) []byte {
	q := new(dns.Msg)
	q.SetQuestion(name, qtype)
	q.Id = 4242
	b, err := q.Pack()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestProxyAnswer(t *testing.T) {
	allow := Policy{Mode: AllowList, Domains: []string{"*.allowed.test", "denied.test"}}.normalized()
	onlyAllowed := Policy{Mode: AllowList, Domains: []string{"allowed.test"}}
	deny := Policy{Mode: DenyList, Domains: []string{"denied.test"}}
	a1, a2, a9 := netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("192.0.2.2"), netip.MustParseAddr("192.0.2.9")
	cases := []struct {
		name    string
		policy  Policy
		q       []byte
		rcode   int
		answers int
		learn   []learnCall
		asked   bool
	}{
		{"allow-all forwards", Policy{}, query(t, "allowed.test.", dns.TypeA), dns.RcodeSuccess, 2, nil, true},
		{"allow-all nxdomain", Policy{}, query(t, "nowhere.test.", dns.TypeA), dns.RcodeNameError, 0, nil, true},
		{"deny-all refuses", Policy{Mode: DenyAll}, query(t, "allowed.test.", dns.TypeA), dns.RcodeRefused, 0, nil, false},
		{"allow-list learns, ttl clamped", onlyAllowed, query(t, "ALLOWED.test.", dns.TypeA), dns.RcodeSuccess, 2,
			[]learnCall{{"allowed.test", false, []netip.Addr{a1, a2}, minLearnTTL}}, true},
		{"allow-list wildcard learns the cname chain", allow, query(t, "cname.allowed.test.", dns.TypeA), dns.RcodeSuccess, 2,
			[]learnCall{{"cname.allowed.test", false, []netip.Addr{a9}, 300 * time.Second}}, true},
		{"allow-list refuses others", onlyAllowed, query(t, "other.test.", dns.TypeA), dns.RcodeRefused, 0, nil, false},
		{"allow-list refuses subdomains of an exact name", onlyAllowed, query(t, "x.allowed.test.", dns.TypeA), dns.RcodeRefused, 0, nil, false},
		{"aaaa gets no records", onlyAllowed, query(t, "allowed.test.", dns.TypeAAAA), dns.RcodeSuccess, 0, nil, false},
		{"deny-list nxdomain, resolved for the deny set", deny, query(t, "denied.test.", dns.TypeA), dns.RcodeNameError, 0,
			[]learnCall{{"denied.test", true, []netip.Addr{netip.MustParseAddr("198.51.100.1")}, 300 * time.Second}}, true},
		{"deny-list forwards others", deny, query(t, "allowed.test.", dns.TypeA), dns.RcodeSuccess, 2, nil, true},
		{"not a query", Policy{}, func() []byte {
			m := new(dns.Msg)
			m.SetNotify("allowed.test.")
			b, _ := m.Pack()
			return b
		}(), dns.RcodeNotImplemented, 0, nil, false},
		{"two questions", Policy{}, func() []byte {
			m := new(dns.Msg)
			m.SetQuestion("a.test.", dns.TypeA)
			m.Question = append(m.Question, m.Question[0])
			b, _ := m.Pack()
			return b
		}(), dns.RcodeFormatError, 0, nil, false},
		{"chaos class", Policy{}, func() []byte {
			m := new(dns.Msg)
			m.SetQuestion("version.bind.", dns.TypeTXT)
			m.Question[0].Qclass = dns.ClassCHAOS
			b, _ := m.Pack()
			return b
		}(), dns.RcodeRefused, 0, nil, false},
		{"garbage", Policy{}, []byte{0x12, 0x34, 0x01, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0xff}, dns.RcodeFormatError, 0, nil, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			up := &zoneUpstream{}
			ll := &learnLog{}
			px := newProxy(tc.policy.normalized(), up, ll.learn, quietLog())
			resp := px.answer(context.Background(), tc.q, true)
			px.bg.Wait()
			var r dns.Msg
			if err := r.Unpack(resp); err != nil {
				t.Fatalf("reply does not parse: %v", err)
			}
			if !r.Response || r.Id != uint16(tc.q[0])<<8|uint16(tc.q[1]) {
				t.Errorf("reply header %+v", r.MsgHdr)
			}
			if r.Rcode != tc.rcode {
				t.Errorf("rcode %s, want %s", dns.RcodeToString[r.Rcode], dns.RcodeToString[tc.rcode])
			}
			if len(r.Answer) != tc.answers {
				t.Errorf("%d answers, want %d: %v", len(r.Answer), tc.answers, r.Answer)
			}
			got := ll.calls()
			if len(got) != len(tc.learn) {
				t.Fatalf("learned %+v, want %+v", got, tc.learn)
			}
			for i := range got {
				if got[i].name != tc.learn[i].name || got[i].deny != tc.learn[i].deny || !slices.Equal(got[i].addrs, tc.learn[i].addrs) || got[i].ttl != tc.learn[i].ttl {
					t.Errorf("learned %+v, want %+v", got[i], tc.learn[i])
				}
			}
			if asked := len(up.asked) > 0; asked != tc.asked { // no more goroutines: no lock needed
				t.Errorf("upstream asked %v, want asked %v", up.asked, tc.asked)
			}
		})
	}
	t.Run("a response is not answered", func(t *testing.T) {
		m := new(dns.Msg)
		m.SetQuestion("a.test.", dns.TypeA)
		m.Response = true
		b, _ := m.Pack()
		if resp := newProxy(Policy{}, &zoneUpstream{}, (&learnLog{}).learn, quietLog()).answer(context.Background(), b, true); resp != nil {
			t.Errorf("answered a response")
		}
	})
	t.Run("upstream failure is servfail", func(t *testing.T) {
		px := newProxy(Policy{}, &zoneUpstream{fail: true}, (&learnLog{}).learn, quietLog())
		var r dns.Msg
		if err := r.Unpack(px.answer(context.Background(), query(t, "allowed.test.", dns.TypeA), true)); err != nil || r.Rcode != dns.RcodeServerFailure {
			t.Errorf("reply %v, %v, want SERVFAIL", r.Rcode, err)
		}
	})
	t.Run("learning failure is servfail", func(t *testing.T) {
		ll := &learnLog{err: errPolicyChanged}
		px := newProxy(onlyAllowed.normalized(), &zoneUpstream{}, ll.learn, quietLog())
		var r dns.Msg
		if err := r.Unpack(px.answer(context.Background(), query(t, "allowed.test.", dns.TypeA), true)); err != nil || r.Rcode != dns.RcodeServerFailure || len(r.Answer) != 0 {
			t.Errorf("reply %v %v, %v, want SERVFAIL without answers", r.Rcode, r.Answer, err)
		}
	})
}

// FuzzProxy feeds arbitrary bytes to the proxy as a query under every
// mode: it must not panic, and a reply must parse and be a response.
func FuzzProxy(f *testing.F) {
	for _, name := range []string{"allowed.test.", "cname.allowed.test.", "denied.test.", "x."} {
		for _, qt := range []uint16{dns.TypeA, dns.TypeAAAA, dns.TypeTXT} {
			for mode := range 4 {
				f.Add(uint8(mode), query(f, name, qt))
			}
		}
	}
	f.Add(uint8(0), []byte{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Add(uint8(2), []byte{0x12, 0x34, 0x80})
	pols := []Policy{
		{Mode: AllowAll},
		{Mode: DenyAll},
		{Mode: AllowList, Domains: []string{"*.allowed.test"}},
		{Mode: DenyList, Domains: []string{"denied.test"}},
	}
	f.Fuzz(func(t *testing.T, mode uint8, req []byte) {
		px := newProxy(pols[int(mode)%len(pols)].normalized(), &zoneUpstream{}, (&learnLog{}).learn, quietLog())
		for _, udp := range []bool{true, false} {
			resp := px.answer(context.Background(), req, udp)
			px.bg.Wait()
			if resp == nil {
				continue
			}
			if udp && len(resp) > maxQuerySize {
				t.Fatalf("UDP reply of %d bytes", len(resp))
			}
			var r dns.Msg
			if err := r.Unpack(resp); err != nil {
				t.Fatalf("reply does not parse: %v", err)
			}
			if !r.Response || r.Id != uint16(req[0])<<8|uint16(req[1]) {
				t.Fatalf("reply header %+v for query id %x", r.MsgHdr, req[:2])
			}
		}
	})
}
