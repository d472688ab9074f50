package daemon

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// pool keeps a template's warm sandboxes: restored from its snapshot and
// ready, to be handed out on create under a new identity (Instance.
// Refresh), and refilled in the background. Its sandboxes count against
// the host's limits; a refill that would pass them waits.
type pool struct {
	s    *Server
	t    *template
	size int

	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}
	wake   chan struct{}

	mu    sync.Mutex
	ready []*warmSandbox
}

// warmSandbox is a pool's ready sandbox and its network (nil without
// one), which waits with deny-all.
type warmSandbox struct {
	inst Instance
	net  *netRecord
}

// closeWarm closes the pool's sandbox w and removes its network.
func (s *Server) closeWarm(w *warmSandbox) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := w.inst.Close(ctx); err != nil {
		s.log.Warn("pool sandbox not closed", "err", err)
	}
	s.detachNet(w.net)
}

// Backoff of a pool whose refills fail.
const (
	poolRetryMin = time.Second
	poolRetryMax = time.Minute
)

// startPool starts t's pool, if it has one.
func (s *Server) startPool(t *template) {
	if t.rec.PoolSize == 0 {
		return
	}
	p := &pool{s: s, t: t, size: int(t.rec.PoolSize), done: make(chan struct{}), wake: make(chan struct{}, 1)}
	p.ctx, p.cancel = context.WithCancel(s.ctx)
	s.mu.Lock()
	if s.closed || s.templates[t.rec.ID] != t || t.pool != nil {
		s.mu.Unlock()
		p.cancel()
		return
	}
	t.pool = p
	s.mu.Unlock()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		p.run()
	}()
}

func (p *pool) readyCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.ready)
}

// run refills the pool until it is closed, then closes its sandboxes.
func (p *pool) run() {
	defer close(p.done)
	defer p.drain()
	s := p.s
	mem := uint64(p.t.rec.MemoryMiB)
	retry := poolRetryMin
	failing := false
	for p.ctx.Err() == nil {
		if p.readyCount() >= p.size {
			select {
			case <-p.wake:
			case <-p.ctx.Done():
			}
			continue
		}
		s.mu.Lock()
		err := s.admitLocked(1, mem)
		if err == nil {
			s.pooled++
			s.pooledMiB += mem
		}
		s.mu.Unlock()
		if err == nil {
			var w *warmSandbox
			if w, err = p.fill(); err == nil {
				p.mu.Lock()
				p.ready = append(p.ready, w)
				p.mu.Unlock()
				if failing {
					s.log.Info("template pool refills again", "template", p.t.rec.ID)
				}
				retry, failing = poolRetryMin, false
				continue
			}
			p.unaccount(1)
		}
		if p.ctx.Err() != nil {
			return
		}
		// Once per streak of failures: a pool that cannot refill (host
		// full, image gone) logs a line, not one per try.
		if !failing {
			s.log.Warn("template pool cannot refill; retrying", "template", p.t.rec.ID, "err", err)
			failing = true
		}
		select {
		case <-time.After(retry):
		case <-p.wake:
		case <-p.ctx.Done():
		}
		retry = min(2*retry, poolRetryMax)
	}
}

// fill restores one sandbox from the template, on a network of its own
// (named as its folder) with deny-all when the template has a card.
func (p *pool) fill() (*warmSandbox, error) {
	s := p.s
	withNet, err := s.sourceNet("template "+p.t.rec.ID, p.t.rec.Net, false)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(s.cfg.StateDir, sandboxesDir, newID(poolPrefix))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	var n *netRecord
	if withNet {
		if n, err = s.attachNet(p.ctx, filepath.Base(dir), EgressPolicy{Mode: EgressDenyAll}); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}
	ctx, cancel := s.bootCtx(p.ctx)
	defer cancel()
	inst, err := s.createNet(ctx, CreateSpec{Dir: dir, Checkpoint: p.t.rec.Dir, Hostname: "pool",
		CPUs: int(p.t.rec.CPUs), MemoryMiB: int(p.t.rec.MemoryMiB)}, n) // the template's, for its cgroup
	if err != nil {
		os.RemoveAll(dir)
		s.detachNet(n)
		return nil, err
	}
	return &warmSandbox{inst: inst, net: n}, nil
}

// unaccount gives back the host's share of n pool sandboxes.
func (p *pool) unaccount(n int) {
	s := p.s
	s.mu.Lock()
	s.pooled -= n
	s.pooledMiB -= uint64(n) * uint64(p.t.rec.MemoryMiB)
	s.mu.Unlock()
}

// takeLocked hands out a ready sandbox, or nil; s.mu is held (the
// sandbox's share of the host moves to its box).
func (p *pool) takeLocked() *warmSandbox {
	p.mu.Lock()
	defer p.mu.Unlock()
	for len(p.ready) > 0 {
		w := p.ready[0]
		p.ready = p.ready[1:]
		p.s.pooled--
		p.s.pooledMiB -= uint64(p.t.rec.MemoryMiB)
		select {
		case <-w.inst.Done(): // stopped while it waited
			go p.s.closeWarm(w)
			continue
		default:
		}
		p.poke()
		return w
	}
	return nil
}

// pokePools wakes every template's refiller: a sandbox ended, so a pool
// that the host's limits held back may fit now, without waiting out its
// backoff.
func (s *Server) pokePools() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, t := range s.templates {
		if t.pool != nil {
			t.pool.poke()
		}
	}
}

// poke wakes the refiller.
func (p *pool) poke() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// close stops the refills and closes the pool's sandboxes.
func (p *pool) close() {
	p.cancel()
	<-p.done
}

// drain closes the ready sandboxes.
func (p *pool) drain() {
	p.mu.Lock()
	ins := p.ready
	p.ready = nil
	p.mu.Unlock()
	var wg sync.WaitGroup
	for _, w := range ins {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.s.closeWarm(w)
		}()
	}
	wg.Wait()
	p.unaccount(len(ins))
}
