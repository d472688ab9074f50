package daemon_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/hostnet"
)

// fakeNet is a daemon.Network of files: an attachment's "network
// namespace" is a file in dir, which the test double's VMM must find to
// open its tap. It counts what the server does to each attachment.
type fakeNet struct {
	t   *testing.T
	dir string

	mu       sync.Mutex
	atts     map[string]daemon.NetInfo
	policy   map[string]daemon.EgressPolicy
	next     int
	attached map[string]int // Attach calls that made one
	removed  map[string]int // Detach calls that removed one
	adopted  map[string]int
	sets     map[string][]daemon.EgressPolicy
	// failAttach, when set, fails the Attach of the IDs it says.
	failAttach func(id string) error
}

func newFakeNet(t *testing.T) *fakeNet {
	return &fakeNet{t: t, dir: t.TempDir(), atts: map[string]daemon.NetInfo{}, policy: map[string]daemon.EgressPolicy{},
		attached: map[string]int{}, removed: map[string]int{}, adopted: map[string]int{}, sets: map[string][]daemon.EgressPolicy{}}
}

func (f *fakeNet) Attach(ctx context.Context, id string, p daemon.EgressPolicy) (daemon.NetInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failAttach != nil {
		if err := f.failAttach(id); err != nil {
			return daemon.NetInfo{}, err
		}
	}
	if _, ok := f.atts[id]; ok {
		return daemon.NetInfo{}, fmt.Errorf("fakenet: %s is attached already", id)
	}
	f.next++
	n := f.next
	path := filepath.Join(f.dir, id)
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		return daemon.NetInfo{}, err
	}
	base := netip.AddrFrom4([4]byte{10, 200, byte(n >> 6), byte(n<<2) & 0xff})
	info := daemon.NetInfo{Netns: path, Tap: "tap0", MAC: fmt.Sprintf("02:00:00:00:%02x:%02x", n>>8, n&0xff),
		Address: netip.PrefixFrom(base.Next().Next(), 30), Gateway: base.Next(), MTU: 1500}
	f.atts[id], f.policy[id] = info, p
	f.attached[id]++
	return info, nil
}

func (f *fakeNet) Adopt(ctx context.Context, id string) (daemon.NetInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	info, ok := f.atts[id]
	if !ok {
		return daemon.NetInfo{}, fmt.Errorf("fakenet: no attachment %s", id)
	}
	f.adopted[id]++
	return info, nil
}

func (f *fakeNet) SetPolicy(ctx context.Context, id string, p daemon.EgressPolicy) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.atts[id]; !ok {
		return fmt.Errorf("fakenet: no attachment %s", id)
	}
	f.policy[id] = p
	f.sets[id] = append(f.sets[id], p)
	return nil
}

func (f *fakeNet) Detach(ctx context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.atts[id]; !ok {
		return nil
	}
	delete(f.atts, id)
	delete(f.policy, id)
	f.removed[id]++
	return os.Remove(filepath.Join(f.dir, id))
}

func (f *fakeNet) List() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var ids []string
	for id := range f.atts {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}

// add makes an attachment behind the server's back (a leftover).
func (f *fakeNet) add(id string) {
	f.t.Helper()
	if _, err := f.Attach(context.Background(), id, daemon.EgressPolicy{}); err != nil {
		f.t.Fatal(err)
	}
}

// count reads m[id] (a counter of f's).
func (f *fakeNet) count(m map[string]int, id string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return m[id]
}

func (f *fakeNet) updates(id string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.sets[id])
}

func killPID(pid int32) error { return syscall.Kill(int(pid), syscall.SIGKILL) }

func (f *fakeNet) has(id string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, ok := f.atts[id]
	return ok
}

func (f *fakeNet) policyOf(id string) daemon.EgressPolicy {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.policy[id]
}

// balanced checks that every attachment made was removed exactly once,
// but those of want (still attached, once).
func (f *fakeNet) balanced(want ...string) {
	f.t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	for id, n := range f.attached {
		live := slices.Contains(want, id)
		if n != 1 {
			f.t.Errorf("attachment %s made %d times", id, n)
		}
		if r := f.removed[id]; live && r != 0 || !live && r != 1 {
			f.t.Errorf("attachment %s removed %d times (live: %v)", id, r, live)
		}
	}
	var ids []string
	for id := range f.atts {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	sort.Strings(want)
	if !slices.Equal(ids, want) {
		f.t.Errorf("attachments %v, want %v", ids, want)
	}
}

func newNetEnv(t *testing.T, mod func(*daemon.Config)) (*env, *fakeNet) {
	fn := newFakeNet(t)
	e := newEnv(t, func(c *daemon.Config) {
		c.Network = fn
		if mod != nil {
			mod(c)
		}
	})
	return e, fn
}

// guestNet checks that sandbox sb's network is its attachment's, and
// that its guest was configured with it.
func (e *env) guestNet(sb *kilnpb.Sandbox, fn *fakeNet, attachment string) {
	e.t.Helper()
	fn.mu.Lock()
	info, ok := fn.atts[attachment]
	fn.mu.Unlock()
	if !ok {
		e.t.Fatalf("sandbox %s: no attachment %s", sb.Id, attachment)
	}
	n := sb.GetNetwork()
	if n.GetAddress() != info.Address.String() || n.GetGateway() != info.Gateway.String() || n.GetMac() != info.MAC ||
		n.GetNetns() != info.Netns || n.GetTap() != info.Tap {
		e.t.Errorf("sandbox %s: network %v, want %+v", sb.Id, n, info)
	}
	in := e.be.ByPID(int(sb.Pid))
	if in == nil {
		e.t.Fatalf("sandbox %s: no instance of pid %d", sb.Id, sb.Pid)
	}
	nic, cfg := in.Network()
	if nic == nil || nic.Tap != info.Tap || nic.Netns != info.Netns || nic.MAC != info.MAC {
		e.t.Errorf("sandbox %s: card %+v, want the attachment's %+v", sb.Id, nic, info)
	}
	if cfg == nil || cfg.MAC != info.MAC || len(cfg.Addresses) != 1 || cfg.Addresses[0] != info.Address ||
		cfg.Gateway != info.Gateway || cfg.MTU != info.MTU || !slices.Equal(cfg.Nameservers, []netip.Addr{info.Gateway}) {
		e.t.Errorf("sandbox %s: guest configured with %+v, want %+v", sb.Id, cfg, info)
	}
}

func allowList(cidrs ...string) *kilnpb.EgressPolicy {
	return &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_ALLOW_LIST, Cidrs: cidrs}
}

// TestNetworkCreateDestroy: an image's sandbox gets a network (the
// default policy, or the request's), its guest is configured, and
// destroy removes it once.
func TestNetworkCreateDestroy(t *testing.T) {
	e, fn := newNetEnv(t, func(c *daemon.Config) { c.DefaultEgress = daemon.EgressPolicy{Mode: daemon.EgressDenyAll} })
	a := e.create(nil)
	e.guestNet(a, fn, a.Id)
	if m := a.GetNetwork().GetEgress().GetMode(); m != kilnpb.EgressPolicy_MODE_DENY_ALL {
		t.Errorf("default egress %v, want deny-all", m)
	}
	b := e.create(&kilnpb.CreateSandboxRequest{Egress: &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_ALLOW_LIST,
		Cidrs: []string{"192.0.2.7", "198.51.100.0/24"}, Domains: []string{"*.example.com"}}})
	e.guestNet(b, fn, b.Id)
	want := daemon.EgressPolicy{Mode: daemon.EgressAllowList,
		CIDRs:   []netip.Prefix{netip.MustParsePrefix("192.0.2.7/32"), netip.MustParsePrefix("198.51.100.0/24")},
		Domains: []string{"*.example.com"}}
	if got := fn.policyOf(b.Id); got.Mode != want.Mode || !slices.Equal(got.CIDRs, want.CIDRs) || !slices.Equal(got.Domains, want.Domains) {
		t.Errorf("policy %+v, want %+v", got, want)
	}
	if a.Network.Address == b.Network.Address || a.Network.Mac == b.Network.Mac {
		t.Errorf("two sandboxes share %v / %v", a.Network, b.Network)
	}
	for _, sb := range []*kilnpb.Sandbox{a, b} {
		if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
			t.Fatal(err)
		}
	}
	fn.balanced()
	// A VMM process that dies takes its sandbox's network with it.
	c := e.create(nil)
	if err := killPID(c.Pid); err != nil {
		t.Fatal(err)
	}
	e.waitState(c.Id, kilnpb.SandboxState_SANDBOX_STATE_FAILED)
	fn.balanced()
	// So does a lifetime that ends.
	d := e.create(&kilnpb.CreateSandboxRequest{LifetimeMs: 60_000})
	e.waitPending(1)
	e.clock.Advance(time.Minute)
	e.waitState(d.Id, kilnpb.SandboxState_SANDBOX_STATE_TIMED_OUT)
	fn.balanced()
	// An ended sandbox still says what its network was.
	if got := e.get(a.Id).GetNetwork().GetAddress(); got != a.Network.Address {
		t.Errorf("ended sandbox's address %q", got)
	}
	_, err := e.c.UpdateNetworkPolicy(ctxT(t), &kilnpb.UpdateNetworkPolicyRequest{Id: a.Id, Egress: allowList("10.0.0.0/8")})
	wantCode(t, err, codes.FailedPrecondition, "ended")
}

// TestNetworkBadPolicies: each bad policy is InvalidArgument naming its
// field, in a create, a template and an update; without networks any
// policy is FailedPrecondition naming the flag.
func TestNetworkBadPolicies(t *testing.T) {
	e, fn := newNetEnv(t, nil)
	sb := e.create(nil)
	many := make([]string, 257)
	for i := range many {
		many[i] = fmt.Sprintf("10.%d.%d.0/24", i/256, i%256)
	}
	for _, tc := range []struct {
		name string
		p    *kilnpb.EgressPolicy
		want string
	}{
		{"mode", &kilnpb.EgressPolicy{Mode: 9}, "egress.mode 9"},
		{"cidr syntax", allowList("10.0.0.0/8", "10.1"), "egress.cidrs[1]"},
		{"cidr prefix", allowList("10.0.0.0/33"), "egress.cidrs[0]"},
		{"cidr zone", allowList("fe80::1%eth0"), "egress.cidrs[0]"},
		{"ipv6", allowList("2001:db8::/32"), "IPv4"},
		{"too many cidrs", allowList(many...), "at most 256"},
		{"domain syntax", &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_DENY_LIST, Domains: []string{"ok.test", "bad domain"}}, "egress.domains[1]"},
		{"domain label", &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_ALLOW_LIST, Domains: []string{"-x.test"}}, "egress.domains[0]"},
		{"empty domain", &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_ALLOW_LIST, Domains: []string{"*."}}, "egress.domains[0]"},
		{"long domain", &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_ALLOW_LIST, Domains: []string{strings.Repeat("a.", 127) + "a"}}, "at most 253"},
		{"lists on allow-all", &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_ALLOW_ALL, Cidrs: []string{"10.0.0.0/8"}}, "takes no"},
		{"lists on deny-all", &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_DENY_ALL, Domains: []string{"a.test"}}, "takes no"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.c.CreateSandbox(ctxT(t), &kilnpb.CreateSandboxRequest{RequestId: nextReq(),
				Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}, Egress: tc.p})
			wantCode(t, err, codes.InvalidArgument, tc.want)
			_, err = e.c.CreateTemplate(ctxT(t), &kilnpb.CreateTemplateRequest{RequestId: nextReq(), Image: "busybox", Egress: tc.p})
			wantCode(t, err, codes.InvalidArgument, tc.want)
			_, err = e.c.UpdateNetworkPolicy(ctxT(t), &kilnpb.UpdateNetworkPolicyRequest{Id: sb.Id, Egress: tc.p})
			wantCode(t, err, codes.InvalidArgument, tc.want)
		})
	}
	_, err := e.c.UpdateNetworkPolicy(ctxT(t), &kilnpb.UpdateNetworkPolicyRequest{Id: sb.Id})
	wantCode(t, err, codes.InvalidArgument, "egress is unset")
	_, err = e.c.UpdateNetworkPolicy(ctxT(t), &kilnpb.UpdateNetworkPolicyRequest{Id: "sb-nope", Egress: allowList()})
	wantCode(t, err, codes.NotFound, "sb-nope")
	fn.balanced(sb.Id) // the refused creates attached nothing

	// No networks: a policy is refused, naming the flag.
	plain := newEnv(t, nil)
	_, err = plain.c.CreateSandbox(ctxT(t), &kilnpb.CreateSandboxRequest{RequestId: nextReq(),
		Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}, Egress: allowList("10.0.0.0/8")})
	wantCode(t, err, codes.FailedPrecondition, "--net-pool")
	_, err = plain.c.CreateTemplate(ctxT(t), &kilnpb.CreateTemplateRequest{RequestId: nextReq(), Image: "busybox", Egress: allowList()})
	wantCode(t, err, codes.FailedPrecondition, "--net-pool")
	psb := plain.create(nil)
	if psb.Network != nil {
		t.Errorf("a sandbox without networks has one: %v", psb.Network)
	}
	_, err = plain.c.UpdateNetworkPolicy(ctxT(t), &kilnpb.UpdateNetworkPolicyRequest{Id: psb.Id, Egress: allowList()})
	wantCode(t, err, codes.FailedPrecondition, "--net-pool")

	// A bad default policy is the server's error.
	_, err = daemon.New(daemon.Config{StateDir: t.TempDir(), Backend: e.be,
		DefaultEgress: daemon.EgressPolicy{Mode: daemon.EgressDenyAll, Domains: []string{"a.test"}}})
	if err == nil || !strings.Contains(err.Error(), "default egress policy") {
		t.Errorf("bad default policy: %v", err)
	}
}

// TestNetworkUpdatePolicy: an update applies to the sandbox's attachment
// at once, shows in its description and outlives a restart.
func TestNetworkUpdatePolicy(t *testing.T) {
	e, fn := newNetEnv(t, nil)
	sb := e.create(&kilnpb.CreateSandboxRequest{Egress: &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_DENY_ALL}})
	got, err := e.c.UpdateNetworkPolicy(ctxT(t), &kilnpb.UpdateNetworkPolicyRequest{Id: sb.Id, Egress: allowList("203.0.113.0/24")})
	if err != nil {
		t.Fatal(err)
	}
	if eg := got.GetNetwork().GetEgress(); eg.GetMode() != kilnpb.EgressPolicy_MODE_ALLOW_LIST || !slices.Equal(eg.GetCidrs(), []string{"203.0.113.0/24"}) {
		t.Errorf("updated egress %v", eg)
	}
	if p := fn.policyOf(sb.Id); p.Mode != daemon.EgressAllowList || fn.updates(sb.Id) != 1 {
		t.Errorf("attachment's policy %+v after %d updates", p, fn.updates(sb.Id))
	}
	// Paused: the policy is the host's, it still updates.
	if _, err := e.c.PauseSandbox(ctxT(t), &kilnpb.PauseSandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.c.UpdateNetworkPolicy(ctxT(t), &kilnpb.UpdateNetworkPolicyRequest{Id: sb.Id,
		Egress: &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_DENY_LIST, Domains: []string{"denied.test"}}}); err != nil {
		t.Fatal(err)
	}
	e.stop()
	e.start()
	after := e.get(sb.Id)
	if eg := after.GetNetwork().GetEgress(); eg.GetMode() != kilnpb.EgressPolicy_MODE_DENY_LIST || !slices.Equal(eg.GetDomains(), []string{"denied.test"}) {
		t.Errorf("egress after a restart %v", eg)
	}
	if n := fn.count(fn.adopted, sb.Id); n != 1 {
		t.Errorf("attachment adopted %d times", n)
	}
	// The state folder has the policy, and nothing of the secret kind.
	b, err := os.ReadFile(filepath.Join(e.state, "sandboxes", sb.Id+".json"))
	if err != nil || !strings.Contains(string(b), "denied.test") {
		t.Errorf("record: %s %v", b, err)
	}
}

// TestNetworkForkRollback: fork children (of a running sandbox and of a
// checkpoint) each get an attachment of their own with the parent's
// policy and a configured guest; a rollback stays on its attachment and
// reconfigures the guest; every attachment goes with its sandbox.
func TestNetworkForkRollback(t *testing.T) {
	e, fn := newNetEnv(t, nil)
	parent := e.create(&kilnpb.CreateSandboxRequest{Egress: allowList("192.0.2.0/24")})
	kids, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: parent.Id}, Count: 2})
	if err != nil || len(kids) != 2 {
		t.Fatalf("fork: %v %v", kids, err)
	}
	ck := e.checkpoint(parent.Id, false)
	// The parent's policy changes after the checkpoint: its children get
	// the checkpoint's.
	if _, err := e.c.UpdateNetworkPolicy(ctxT(t), &kilnpb.UpdateNetworkPolicyRequest{Id: parent.Id,
		Egress: &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_DENY_ALL}}); err != nil {
		t.Fatal(err)
	}
	ckKids, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: ck.Id}, Count: 2})
	if err != nil || len(ckKids) != 2 {
		t.Fatalf("fork from checkpoint: %v %v", ckKids, err)
	}
	addrs := map[string]bool{parent.Network.Address: true}
	for _, k := range append(kids, ckKids...) {
		e.guestNet(k, fn, k.Id)
		if addrs[k.Network.Address] {
			t.Errorf("child %s has a sibling's or its parent's address %s", k.Id, k.Network.Address)
		}
		addrs[k.Network.Address] = true
		if p := fn.policyOf(k.Id); p.Mode != daemon.EgressAllowList || !slices.Equal(p.CIDRs, []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}) {
			t.Errorf("child %s: policy %+v, want the parent's", k.Id, p)
		}
	}

	// Rollback in place: the same attachment, the guest reconfigured.
	before := e.get(parent.Id)
	rb, err := e.c.Rollback(ctxT(t), &kilnpb.RollbackRequest{SandboxId: parent.Id, CheckpointId: ck.Id})
	if err != nil {
		t.Fatal(err)
	}
	if rb.Network.Address != before.Network.Address || rb.Network.Mac != before.Network.Mac || rb.Pid == before.Pid {
		t.Errorf("rollback: network %v pid %d, was %v pid %d", rb.Network, rb.Pid, before.Network, before.Pid)
	}
	if rb.Network.Egress.Mode != kilnpb.EgressPolicy_MODE_DENY_ALL {
		t.Errorf("rollback changed the policy: %v", rb.Network.Egress)
	}
	e.guestNet(rb, fn, parent.Id)

	// A child of a child.
	grand, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: kids[0].Id}, Count: 1})
	if err != nil || len(grand) != 1 {
		t.Fatalf("fork of a child: %v %v", grand, err)
	}
	e.guestNet(grand[0], fn, grand[0].Id)

	all := append(append(append([]*kilnpb.Sandbox{parent}, kids...), ckKids...), grand...)
	var live []string
	for _, sb := range all {
		live = append(live, sb.Id)
	}
	fn.balanced(live...)
	for _, sb := range all {
		if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
			t.Fatal(err)
		}
	}
	fn.balanced()
}

// TestNetworkTemplatePool: a template's builder and pool sandboxes have
// networks of their own (the pool's with deny-all until handed out, when
// the request's policy replaces it); a template made without networks
// makes sandboxes without one.
func TestNetworkTemplatePool(t *testing.T) {
	e, fn := newNetEnv(t, nil)
	tp := e.createTemplate(&kilnpb.CreateTemplateRequest{Setup: setupScript, PoolSize: 1, Egress: allowList("192.0.2.1")})
	fn.mu.Lock()
	var builders, pooled []string
	for id := range fn.attached {
		switch {
		case strings.HasPrefix(id, "tb-"):
			builders = append(builders, id)
		case strings.HasPrefix(id, "pl-"):
			pooled = append(pooled, id)
		}
	}
	fn.mu.Unlock()
	if len(builders) != 1 || fn.has(builders[0]) {
		t.Errorf("builder attachments %v (still there: %v)", builders, len(builders) > 0 && fn.has(builders[0]))
	}
	e.waitPool(tp.Id, 1)
	fn.mu.Lock()
	pooled = pooled[:0]
	for id := range fn.atts {
		if strings.HasPrefix(id, "pl-") {
			pooled = append(pooled, id)
		}
	}
	fn.mu.Unlock()
	if len(pooled) != 1 || fn.policyOf(pooled[0]).Mode != daemon.EgressDenyAll {
		t.Fatalf("pool attachments %v, policy %+v", pooled, fn.policyOf(pooled[0]))
	}

	// Handed out: the pool's attachment with the request's policy.
	req := fromTemplate(tp.Id)
	req.Egress = &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_ALLOW_LIST, Domains: []string{"allowed.test"}}
	sb := e.create(req)
	if !sb.FromPool {
		t.Fatal("not from the pool")
	}
	e.guestNet(sb, fn, pooled[0])
	if p := fn.policyOf(pooled[0]); p.Mode != daemon.EgressAllowList || !slices.Equal(p.Domains, []string{"allowed.test"}) {
		t.Errorf("handed-out policy %+v", p)
	}
	if eg := sb.Network.Egress; eg.Mode != kilnpb.EgressPolicy_MODE_ALLOW_LIST {
		t.Errorf("sandbox egress %v", eg)
	}
	if _, err := e.c.UpdateNetworkPolicy(ctxT(t), &kilnpb.UpdateNetworkPolicyRequest{Id: sb.Id, Egress: allowList("10.1.0.0/16")}); err != nil {
		t.Fatal(err)
	}
	if p := fn.policyOf(pooled[0]); p.Mode != daemon.EgressAllowList || len(p.CIDRs) != 1 {
		t.Errorf("update of a handed-out sandbox: %+v", p)
	}
	e.waitPool(tp.Id, 1) // refilled
	// A restore on demand, from a template without a pool.
	tp2 := e.createTemplate(&kilnpb.CreateTemplateRequest{})
	restored := e.create(fromTemplate(tp2.Id))
	if restored.FromPool {
		t.Fatal("from a pool")
	}
	e.guestNet(restored, fn, restored.Id)

	// Delete everything: the pool's attachments go with it.
	sbs, err := e.c.ListSandboxes(ctxT(t), &kilnpb.ListSandboxesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range sbs.Sandboxes {
		if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{tp.Id, tp2.Id} {
		if _, err := e.c.DeleteTemplate(ctxT(t), &kilnpb.DeleteTemplateRequest{Id: id}); err != nil {
			t.Fatal(err)
		}
	}
	fn.balanced()

	// A template made without networks: its sandboxes have none, and a
	// policy for one is refused; with networks off again, a template made
	// with them is refused.
	plain := newEnv(t, nil)
	ptp := plain.createTemplate(&kilnpb.CreateTemplateRequest{})
	plain.stop()
	plain.cfg.Network = fn
	plain.start()
	psb := plain.create(fromTemplate(ptp.Id))
	if psb.Network != nil {
		t.Errorf("sandbox of a template without a card has a network: %v", psb.Network)
	}
	req = fromTemplate(ptp.Id)
	req.RequestId, req.Egress = nextReq(), allowList()
	_, err = plain.c.CreateSandbox(ctxT(t), req)
	wantCode(t, err, codes.FailedPrecondition, "without a network card")
	ntp := plain.createTemplate(&kilnpb.CreateTemplateRequest{})
	plain.stop()
	plain.cfg.Network = nil
	plain.start()
	req = fromTemplate(ntp.Id)
	req.RequestId = nextReq()
	_, err = plain.c.CreateSandbox(ctxT(t), req)
	wantCode(t, err, codes.FailedPrecondition, "--net-pool")
	fn.balanced()
}

// TestNetworkRestart: a restarted server adopts the attachments of the
// sandboxes it takes over, removes those of sandboxes lost meanwhile and
// leftovers, and a failed attach or start leaves nothing.
func TestNetworkRestart(t *testing.T) {
	e, fn := newNetEnv(t, nil)
	a := e.create(nil)
	b := e.create(nil)
	e.stop()
	if err := killPID(b.Pid); err != nil {
		t.Fatal(err)
	}
	fn.add("sb-leftover")
	fn.add("pl-0123456789abcdef")
	e.start()
	if n := fn.count(fn.adopted, a.Id); n != 1 {
		t.Errorf("sandbox %s's attachment adopted %d times", a.Id, n)
	}
	e.waitState(b.Id, kilnpb.SandboxState_SANDBOX_STATE_FAILED)
	fn.balanced(a.Id)
	if got := e.get(a.Id); got.Network.GetAddress() != a.Network.Address {
		t.Errorf("after the restart: %v, was %v", got.Network, a.Network)
	}

	// A failed attach fails the create; a retry with the same request ID
	// starts afresh.
	fn.failAttach = func(id string) error {
		return status.Error(codes.ResourceExhausted, "address pool exhausted")
	}
	req := &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}}
	_, err := e.c.CreateSandbox(ctxT(t), req)
	wantCode(t, err, codes.ResourceExhausted, "address pool exhausted")
	fn.failAttach = nil
	sb, err := e.c.CreateSandbox(ctxT(t), req)
	if err != nil {
		t.Fatal(err)
	}
	// A start that fails after the attach detaches.
	e.be.CreateHook = func(ctx context.Context, spec daemon.CreateSpec) error {
		return errors.New("no such kernel")
	}
	_, err = e.c.CreateSandbox(ctxT(t), &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}})
	if err == nil {
		t.Fatal("a failing start succeeded")
	}
	e.be.CreateHook = nil
	if _, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: a.Id}, Count: 2}); err != nil {
		t.Fatal(err)
	}
	// A fork whose children cannot attach fails them all, leaving
	// nothing.
	var n int
	var mu sync.Mutex
	fn.failAttach = func(id string) error {
		mu.Lock()
		defer mu.Unlock()
		if n++; n == 2 {
			return errors.New("no more taps")
		}
		return nil
	}
	_, err = e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: a.Id}, Count: 3})
	if err == nil || !strings.Contains(err.Error(), "no more taps") {
		t.Fatalf("fork with a failing attach: %v", err)
	}
	fn.failAttach = nil
	live, err := e.c.ListSandboxes(ctxT(t), &kilnpb.ListSandboxesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, l := range live.Sandboxes {
		ids = append(ids, l.Id)
	}
	if !slices.Contains(ids, sb.Id) || len(ids) != 4 { // a, sb and the two children
		t.Errorf("live sandboxes %v", ids)
	}
	fn.balanced(ids...)
	// The four, and a's instance of the first server, which let go of it
	// (detached, not closed): nothing of the failed starts.
	deadline := time.Now().Add(5 * time.Second)
	for e.be.Live() != 5 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if n := e.be.Live(); n != 5 {
		t.Errorf("%d instances live, want 5", n)
	}
}

// TestEgressModesAreHostnets: HostNetwork passes a mode on by value.
func TestEgressModesAreHostnets(t *testing.T) {
	for m := range 4 {
		if d, h := daemon.EgressMode(m).String(), hostnet.Mode(m).String(); d != h {
			t.Errorf("mode %d: daemon %s, hostnet %s", m, d, h)
		}
	}
	for _, name := range []string{"allow-all", "deny-all", "allow-list", "deny-list"} {
		if m, err := daemon.ParseEgressMode(name); err != nil || m.String() != name {
			t.Errorf("ParseEgressMode(%q) = %v, %v", name, m, err)
		}
	}
	if _, err := daemon.ParseEgressMode("allow"); err == nil {
		t.Error("ParseEgressMode(allow) succeeded")
	}
}
