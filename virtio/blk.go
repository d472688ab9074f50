package virtio

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/memory"
)

// Block feature bits (virtio 1.x, section 5.2.3).
const (
	BlockFeatureSegMax  = 1 << 2  // seg_max in the config space is valid
	BlockFeatureRO      = 1 << 5  // the disk is read-only
	BlockFeatureBlkSize = 1 << 6  // blk_size in the config space is valid
	BlockFeatureFlush   = 1 << 9  // VIRTIO_BLK_T_FLUSH is supported
	BlockFeatureMQ      = 1 << 12 // num_queues in the config space is valid
)

// Block request types (section 5.2.6).
const (
	BlockTypeIn    = 0 // read sectors
	BlockTypeOut   = 1 // write sectors
	BlockTypeFlush = 4 // flush the disk's write cache
	BlockTypeGetID = 8 // read the device ID string
)

// Block request status values (section 5.2.6).
const (
	BlockStatusOK     = 0
	BlockStatusIOErr  = 1
	BlockStatusUnsupp = 2
)

const (
	// BlockSectorSize is the unit of capacity and of request sectors.
	BlockSectorSize = 512
	// BlockIDBytes is the largest device ID a GET_ID request returns.
	BlockIDBytes = 20
	// BlockQueueSize is the size of each of the block device's request
	// queues.
	BlockQueueSize = 256
	// BlockMaxQueues bounds BlockConfig.Queues.
	BlockMaxQueues = 16
	// blockSegMax is the seg_max the device advertises: the most data
	// buffers in one request, leaving room for the header and status.
	blockSegMax = BlockQueueSize - 2
	// blockHeaderSize is the request header: type, reserved, sector.
	blockHeaderSize = 16
	// blockNotifyBatch bounds how many requests complete before the
	// driver is interrupted during a long drain of the queue.
	blockNotifyBatch = 32
	// blockWorkers is how many requests of one queue run at once, so that
	// the guest's readahead and its parallel requests overlap on the host
	// instead of waiting for each other. Workers start as requests come
	// and end when none waits: an idle disk keeps no goroutine but its
	// dispatcher.
	blockWorkers = 8
)

// Offsets in struct virtio_blk_config (section 5.2.4).
const (
	blockCfgCapacity = 0  // le64
	blockCfgSegMax   = 12 // le32, after size_max (le32 at 8)
	blockCfgBlkSize  = 20 // le32, after geometry (4 bytes at 16)
	// num_queues (le16), after topology (8 bytes at 24), writeback and
	// unused0.
	blockCfgNumQueues = 34
	blockCfgSize      = 60 // the whole structure, through write_zeroes_may_unmap
)

// BlockConfig describes the backing file of a virtio-blk device.
type BlockConfig struct {
	// Path is the disk image: a regular file or a block device, whose size
	// is a multiple of BlockSectorSize.
	Path string
	// ReadOnly opens the image read-only and offers VIRTIO_BLK_F_RO: the
	// guest's writes fail.
	ReadOnly bool
	// ID is what VIRTIO_BLK_T_GET_ID returns (Linux shows it as
	// /sys/block/vdX/serial), at most BlockIDBytes bytes. Empty means the
	// image's file name, cut to BlockIDBytes.
	ID string
	// Queues is how many request queues the device offers (1 to
	// BlockMaxQueues; 0 means 1). With more than one it offers
	// VIRTIO_BLK_F_MQ: Linux then gives each vCPU (or group of vCPUs) its
	// own queue, so that vCPUs issuing I/O at once do not share one
	// virtqueue's lock, and the device serves each queue on its own.
	Queues int
	// Logger receives the device's logs; slog.Default() when nil.
	Logger *slog.Logger
	// Slot makes the disk a volume slot (see NewBlockSlot): it never
	// offers VIRTIO_BLK_F_RO, whatever ReadOnly says (the device itself
	// refuses a read-only image's writes and flushes), and its snapshot
	// state says it is one. NewBlock and NewBlockFromFile with Slot make
	// a filled slot (a restore's).
	Slot bool
}

// BlockSource is what a read-only disk reads instead of a file: an image
// laid out in this process whose bytes come from elsewhere (package erofs
// lays an image's tree out as an EROFS filesystem whose file data is read
// lazily from the image's chunks). ReadAt fills all of p or returns an
// error; ctx bounds a read that must fetch.
type BlockSource interface {
	// Size is the disk's size in bytes, a multiple of BlockSectorSize.
	Size() int64
	ReadAt(ctx context.Context, p []byte, off int64) (int, error)
}

// Block is a virtio-blk device (virtio 1.x, section 5.2) backed by a file,
// or by a BlockSource (read-only), or a volume slot (NewBlockSlot) that
// takes its file at run time (Insert). It serves each of its request
// queues with blockWorkers requests at once, reading and writing a file
// with preadv and pwritev straight into and out of guest memory.
type Block struct {
	// slot: the disk is a volume slot; it never changes. A slot's file,
	// fd, path, readOnly, capacity and config change once, when Insert
	// fills it: media guards them (a disk that is no slot needs no lock,
	// its media being fixed).
	slot  bool
	media sync.RWMutex

	file     *os.File    // nil for a source-backed disk and an empty slot
	fd       int         // file's descriptor, for preadv and pwritev
	src      BlockSource // nil for a file-backed disk
	srcClose io.Closer   // releases src (may be nil)
	key      string      // what src serves, for its snapshot state
	path     string
	readOnly bool
	capacity uint64 // in sectors
	id       [BlockIDBytes]byte
	config   [blockCfgSize]byte
	log      *slog.Logger

	queues int // request queues offered

	mu     sync.Mutex
	closed bool
	kicks  []chan struct{} // per queue, buffered(1): a pending QueueNotify; nil for a queue not served
	cancel context.CancelFunc
	dones  []chan struct{} // closed when each serving goroutine exits

	// scratch keeps the source reads' buffers (*[]byte) of workers that
	// ended, for the next ones; the runtime drops them when they idle.
	scratch sync.Pool
}

var _ Device = (*Block)(nil)

// NewBlock opens the image cfg names (read-write, or read-only when
// cfg.ReadOnly) and returns a device for it. The image is locked with flock
// (shared when read-only, exclusive otherwise) so that two devices, in this
// process or another, cannot write one image at once. Close releases it.
func NewBlock(cfg BlockConfig) (*Block, error) {
	if cfg.Path == "" {
		return nil, errors.New("virtio-blk: no image path given")
	}
	if len(cfg.ID) > BlockIDBytes {
		return nil, fmt.Errorf("virtio-blk %s: ID %q is %d bytes, at most %d allowed", cfg.Path, cfg.ID, len(cfg.ID), BlockIDBytes)
	}
	flag, lock := os.O_RDWR, unix.LOCK_EX
	if cfg.ReadOnly {
		flag, lock = os.O_RDONLY, unix.LOCK_SH
	}
	// O_NONBLOCK: an open of a FIFO (or of some character devices)
	// named as the image would otherwise block until a writer came;
	// newBlock then refuses anything but a regular file or block device.
	// Regular files and block devices ignore the flag.
	f, err := os.OpenFile(cfg.Path, flag|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("virtio-blk: opening image: %w", err)
	}
	b, err := newBlock(f, cfg, lock)
	if err != nil {
		f.Close()
		return nil, err
	}
	return b, nil
}

// NewBlockFromFile makes a disk over an image already open (a jailer
// opened it, say): read-write unless cfg.ReadOnly, which must match how f
// was opened. The device owns f from the call on, and closes it when it
// fails. cfg.Path only names the image in messages.
func NewBlockFromFile(f *os.File, cfg BlockConfig) (*Block, error) {
	if f == nil {
		return nil, errors.New("virtio-blk: no image file given")
	}
	if cfg.Path == "" {
		cfg.Path = f.Name()
	}
	if len(cfg.ID) > BlockIDBytes {
		f.Close()
		return nil, fmt.Errorf("virtio-blk %s: ID %q is %d bytes, at most %d allowed", cfg.Path, cfg.ID, len(cfg.ID), BlockIDBytes)
	}
	lock := unix.LOCK_EX
	if cfg.ReadOnly {
		lock = unix.LOCK_SH
	} else if fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0); err == nil && fl&unix.O_ACCMODE == unix.O_RDONLY {
		f.Close()
		return nil, fmt.Errorf("virtio-blk %s: the image is open read-only but the disk is read-write", cfg.Path)
	}
	b, err := newBlock(f, cfg, lock)
	if err != nil {
		f.Close()
		return nil, err
	}
	return b, nil
}

func newBlock(f *os.File, cfg BlockConfig, lock int) (*Block, error) {
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("virtio-blk: %w", err)
	}
	if !fi.Mode().IsRegular() && (fi.Mode()&os.ModeDevice == 0 || fi.Mode()&os.ModeCharDevice != 0) {
		return nil, fmt.Errorf("virtio-blk: image %s is a %v, not a regular file or block device", cfg.Path, fi.Mode().Type())
	}
	if err := unix.Flock(int(f.Fd()), lock|unix.LOCK_NB); err != nil {
		return nil, fmt.Errorf("virtio-blk: locking image %s (is another VM using it?): %w", cfg.Path, err)
	}
	// Seek works for block devices too, where Stat reports size 0.
	size, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return nil, fmt.Errorf("virtio-blk: size of image %s: %w", cfg.Path, err)
	}
	if size%BlockSectorSize != 0 {
		return nil, fmt.Errorf("virtio-blk: image %s is %d bytes, not a multiple of the %d-byte sector", cfg.Path, size, BlockSectorSize)
	}
	b, err := configureBlock(cfg, size)
	if err != nil {
		return nil, err
	}
	b.file, b.fd = f, int(f.Fd())
	return b, nil
}

// configureBlock makes the device's fixed part (queues, ID, config space)
// for a disk of size bytes.
func configureBlock(cfg BlockConfig, size int64) (*Block, error) {
	queues := cfg.Queues
	if queues == 0 {
		queues = 1
	}
	if queues < 1 || queues > BlockMaxQueues {
		return nil, fmt.Errorf("virtio-blk: image %s: %d queues, want 1 to %d", cfg.Path, cfg.Queues, BlockMaxQueues)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	b := &Block{
		slot:     cfg.Slot,
		queues:   queues,
		path:     cfg.Path,
		readOnly: cfg.ReadOnly,
		capacity: uint64(size) / BlockSectorSize,
		log:      log.With("device", "virtio-blk", "image", cfg.Path),
	}
	id := cfg.ID
	if id == "" {
		id = filepath.Base(cfg.Path)
	}
	copy(b.id[:], id) // a default longer than BlockIDBytes is cut
	binary.LittleEndian.PutUint64(b.config[blockCfgCapacity:], b.capacity)
	binary.LittleEndian.PutUint32(b.config[blockCfgSegMax:], blockSegMax)
	binary.LittleEndian.PutUint32(b.config[blockCfgBlkSize:], BlockSectorSize)
	binary.LittleEndian.PutUint16(b.config[blockCfgNumQueues:], uint16(queues))
	return b, nil
}

// maxSourceRead bounds the bytes one read from a BlockSource asks for
// when a request's buffers are several: a larger request reads in pieces
// (the worker's scratch buffer is this big at most, so a disk's workers
// keep 1 MiB at most between requests).
const maxSourceRead = 128 << 10

// NewBlockFromSource makes a read-only disk whose bytes are src's. key
// says what src serves (an image's digest and layout): the device's
// snapshot state keeps it, and a restore against a source with another key
// is refused. closer, when not nil, is called when the device is closed.
// cfg.Path only names the disk in messages; cfg.ReadOnly is implied.
func NewBlockFromSource(src BlockSource, key string, closer io.Closer, cfg BlockConfig) (*Block, error) {
	if src == nil {
		return nil, errors.New("virtio-blk: no source given")
	}
	size := src.Size()
	switch {
	case size <= 0 || size%BlockSectorSize != 0:
		return nil, fmt.Errorf("virtio-blk %s: source is %d bytes, want a positive multiple of the %d-byte sector", cfg.Path, size, BlockSectorSize)
	case len(cfg.ID) > BlockIDBytes:
		return nil, fmt.Errorf("virtio-blk %s: ID %q is %d bytes, at most %d allowed", cfg.Path, cfg.ID, len(cfg.ID), BlockIDBytes)
	case key == "":
		return nil, fmt.Errorf("virtio-blk %s: a source needs a key (what it serves)", cfg.Path)
	}
	cfg.ReadOnly = true
	b, err := configureBlock(cfg, size)
	if err != nil {
		return nil, err
	}
	b.fd, b.src, b.srcClose, b.key = -1, src, closer, key
	return b, nil
}

// NewBlockSlot returns an empty volume slot: a disk of no capacity and no
// image, whose serial is cfg.ID (required), into which Insert puts an
// image while the guest runs (the guest sees its capacity change). A
// slot never offers VIRTIO_BLK_F_RO: the read-only-ness of what is
// inserted is the device's to enforce. cfg.Path, when set, only names
// the slot in messages; cfg.ReadOnly is ignored.
func NewBlockSlot(cfg BlockConfig) (*Block, error) {
	if cfg.ID == "" {
		return nil, errors.New("virtio-blk: a slot needs an ID (its serial)")
	}
	if len(cfg.ID) > BlockIDBytes {
		return nil, fmt.Errorf("virtio-blk slot: ID %q is %d bytes, at most %d allowed", cfg.ID, len(cfg.ID), BlockIDBytes)
	}
	if cfg.Path == "" {
		cfg.Path = "slot " + cfg.ID
	}
	cfg.Slot, cfg.ReadOnly = true, false
	b, err := configureBlock(cfg, 0)
	if err != nil {
		return nil, err
	}
	b.fd = -1
	return b, nil
}

// Slot reports whether the disk is a volume slot (NewBlockSlot), and
// whether one holds an image.
func (b *Block) Slot() (slot, filled bool) {
	if !b.slot {
		return false, false
	}
	b.media.RLock()
	defer b.media.RUnlock()
	return true, b.file != nil
}

// Insert puts the image f into an empty volume slot, as the disk the
// guest sees from now on: read-write, or read-only (f must then be open
// O_RDONLY or O_RDWR; writes and flushes are answered
// VIRTIO_BLK_S_IOERR). name names the image in messages and snapshots.
// The image is locked as NewBlock locks it. The caller then tells the
// driver the config space changed (MMIO.ConfigChanged), so that it reads
// the new capacity. On success the device owns f (Close closes it); on
// failure the caller keeps it. A disk that is no slot, or a slot that is
// filled already, is refused.
func (b *Block) Insert(f *os.File, readOnly bool, name string) error {
	if f == nil {
		return fmt.Errorf("virtio-blk %s: insert: no image file given", b.path)
	}
	if name == "" {
		name = f.Name()
	}
	if !b.slot {
		return fmt.Errorf("virtio-blk %s: insert %s: the disk is not a volume slot", b.path, name)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return fmt.Errorf("virtio-blk %s: insert %s: the slot is closed", b.path, name)
	}
	b.media.Lock()
	defer b.media.Unlock()
	if b.file != nil {
		return fmt.Errorf("virtio-blk %s: insert %s: the slot already holds %s", b.path, name, b.path)
	}
	fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0)
	if err != nil {
		return fmt.Errorf("virtio-blk %s: insert %s: %w", b.path, name, err)
	}
	if !readOnly && fl&unix.O_ACCMODE == unix.O_RDONLY {
		return fmt.Errorf("virtio-blk %s: insert %s: the image is open read-only but the volume is read-write", b.path, name)
	}
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("virtio-blk %s: insert %s: %w", b.path, name, err)
	}
	if !fi.Mode().IsRegular() && (fi.Mode()&os.ModeDevice == 0 || fi.Mode()&os.ModeCharDevice != 0) {
		return fmt.Errorf("virtio-blk %s: insert: image %s is a %v, not a regular file or block device", b.path, name, fi.Mode().Type())
	}
	size, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return fmt.Errorf("virtio-blk %s: insert: size of image %s: %w", b.path, name, err)
	}
	if size <= 0 || size%BlockSectorSize != 0 {
		return fmt.Errorf("virtio-blk %s: insert: image %s is %d bytes, want a positive multiple of the %d-byte sector", b.path, name, size, BlockSectorSize)
	}
	lock := unix.LOCK_EX
	if readOnly {
		lock = unix.LOCK_SH
	}
	if err := unix.Flock(int(f.Fd()), lock|unix.LOCK_NB); err != nil {
		return fmt.Errorf("virtio-blk %s: insert: locking image %s (is another VM using it?): %w", b.path, name, err)
	}
	b.file, b.fd, b.path, b.readOnly = f, int(f.Fd()), name, readOnly
	b.capacity = uint64(size) / BlockSectorSize
	binary.LittleEndian.PutUint64(b.config[blockCfgCapacity:], b.capacity)
	b.log.Info("volume inserted", "slot", strings.TrimRight(string(b.id[:]), "\x00"), "image", name, "read_only", readOnly, "sectors", b.capacity)
	return nil
}

// Capacity returns the disk's size in BlockSectorSize sectors.
func (b *Block) Capacity() uint64 {
	if b.slot {
		b.media.RLock()
		defer b.media.RUnlock()
	}
	return b.capacity
}

// Close stops the device and closes the image.
func (b *Block) Close() error {
	b.Reset()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	b.closed = true
	if b.src != nil {
		if b.srcClose != nil {
			if err := b.srcClose.Close(); err != nil {
				return fmt.Errorf("virtio-blk: closing %s: %w", b.path, err)
			}
		}
		return nil
	}
	if b.file == nil { // an empty slot
		return nil
	}
	if err := b.file.Close(); err != nil {
		return fmt.Errorf("virtio-blk: closing image %s: %w", b.path, err)
	}
	return nil
}

// ID returns IDBlock.
func (b *Block) ID() uint32 { return IDBlock }

// Features returns FLUSH, SEG_MAX and BLK_SIZE, RO for a read-only disk
// that is no slot and MQ for more than one queue.
func (b *Block) Features() uint64 {
	f := uint64(BlockFeatureFlush | BlockFeatureSegMax | BlockFeatureBlkSize)
	if !b.slot && b.readOnly {
		f |= BlockFeatureRO
	}
	if b.queues > 1 {
		f |= BlockFeatureMQ
	}
	return f
}

// QueueSizes returns the request queues' sizes.
func (b *Block) QueueSizes() []uint16 {
	sizes := make([]uint16, b.queues)
	for i := range sizes {
		sizes[i] = BlockQueueSize
	}
	return sizes
}

// ReadConfig reads struct virtio_blk_config: capacity, seg_max, blk_size
// and num_queues are set, the rest reads zero, and so does anything past
// its end.
func (b *Block) ReadConfig(offset uint64, data []byte) {
	clear(data)
	if b.slot {
		b.media.RLock()
		defer b.media.RUnlock()
	}
	if offset < uint64(len(b.config)) {
		copy(data, b.config[offset:])
	}
}

// WriteConfig ignores the write: no writable field is offered
// (VIRTIO_BLK_F_CONFIG_WCE is not).
func (b *Block) WriteConfig(offset uint64, data []byte) {}

// Activate starts serving the request queues: queue 0, and the others the
// driver made ready (it may use fewer than offered, and only queue 0
// without MQ).
func (b *Block) Activate(mem *memory.Memory, features uint64, queues []*Queue) error {
	if len(queues) != b.queues || queues[0] == nil {
		return fmt.Errorf("virtio-blk %s: activated with %d queues, want %d", b.path, len(queues), b.queues)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return fmt.Errorf("virtio-blk %s: activated after Close", b.path)
	}
	if b.cancel != nil {
		return fmt.Errorf("virtio-blk %s: activated twice without a reset", b.path)
	}
	ctx, cancel := context.WithCancel(context.Background())
	b.cancel = cancel
	b.kicks = make([]chan struct{}, len(queues))
	b.dones = nil
	for i, q := range queues {
		if i > 0 && (q == nil || !q.Ready || features&BlockFeatureMQ == 0) {
			continue
		}
		kick, done := make(chan struct{}, 1), make(chan struct{})
		kick <- struct{}{} // serve anything queued before DRIVER_OK
		b.kicks[i] = kick
		b.dones = append(b.dones, done)
		go b.serve(ctx, q, kick, done)
	}
	return nil
}

// QueueNotify wakes the goroutine serving queue index; it never blocks.
func (b *Block) QueueNotify(index int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if index < 0 || index >= len(b.kicks) || b.kicks[index] == nil {
		return
	}
	select {
	case b.kicks[index] <- struct{}{}:
	default: // a wake-up is already pending
	}
}

// Reset stops serving the queues, waiting for the requests in progress to
// finish, and forgets the queues.
func (b *Block) Reset() {
	b.mu.Lock()
	cancel, dones := b.cancel, b.dones
	b.kicks, b.cancel, b.dones = nil, nil, nil
	b.mu.Unlock()
	if cancel != nil {
		cancel()
		for _, done := range dones {
			<-done
		}
	}
}

// blkActivation is one activation's serving state: the dispatcher pops
// chains and hands them to the workers through pending; inFlight counts
// chains popped and not yet pushed, sinceNotify pushes since the last
// interrupt decision.
type blkActivation struct {
	q           *Queue
	cancel      context.CancelFunc
	inFlight    atomic.Int32
	sinceNotify atomic.Int32
	wg          sync.WaitGroup

	mu      sync.Mutex
	waiting []*Chain // popped, not yet taken by a worker
	workers int      // running, at most blockWorkers
}

// serve runs an activation: one dispatcher (this goroutine) and up to
// blockWorkers workers, until ctx ends or the driver breaks the queue (the
// transport hears of that through the queue and sets NEEDS_RESET). done is
// closed once every goroutine of the activation has returned.
func (b *Block) serve(ctx context.Context, q *Queue, kick <-chan struct{}, done chan<- struct{}) {
	ctx, cancel := context.WithCancel(ctx)
	a := &blkActivation{q: q, cancel: cancel}
	defer func() {
		cancel()
		a.wg.Wait()
		close(done)
	}()
	for {
		select {
		case <-ctx.Done():
			return
		case <-kick:
		}
		if err := b.dispatch(ctx, a); err != nil {
			if !errors.Is(err, ErrStale) {
				b.log.Warn("request queue stopped", "err", err)
			}
			return
		}
	}
}

// dispatch hands every available request to the workers. Requests run
// concurrently and complete in any order (virtio lets them); a flush
// covers every write completed before it, as the guest expects, since
// fsync covers everything written to the image so far.
func (b *Block) dispatch(ctx context.Context, a *blkActivation) error {
	for ctx.Err() == nil {
		c, ok, err := a.q.Pop()
		if err != nil {
			return err
		}
		if !ok {
			return nil
		}
		a.inFlight.Add(1)
		a.mu.Lock()
		a.waiting = append(a.waiting, c)
		start := a.workers < blockWorkers
		if start {
			a.workers++
			a.wg.Add(1)
		}
		a.mu.Unlock()
		if start {
			go b.work(ctx, a)
		}
	}
	return nil
}

// take hands a worker the oldest chain waiting, or ends the worker
// (ok false) when none waits.
func (a *blkActivation) take() (c *Chain, ok bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.waiting) == 0 {
		a.workers--
		a.waiting = nil // let the backing array go with the burst
		return nil, false
	}
	c = a.waiting[0]
	a.waiting[0] = nil
	a.waiting = a.waiting[1:]
	return c, true
}

// idle says whether no chain waits for a worker.
func (a *blkActivation) idle() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.waiting) == 0
}

// work executes the requests dispatch hands it, pushes each to the used
// ring and interrupts the driver when no other request waits for a worker
// or none is in flight (so a completion is not held back by a slow
// request), or after blockNotifyBatch completions during a long backlog.
// After the activation ends the chains left are dropped: the queue was
// reset and their pushes would be stale.
func (b *Block) work(ctx context.Context, a *blkActivation) {
	defer a.wg.Done()
	var iov [][]byte
	var scratch []byte // a source-backed disk's reads
	if p, ok := b.scratch.Get().(*[]byte); ok {
		scratch = *p
	}
	defer func() {
		if scratch != nil {
			b.scratch.Put(&scratch)
		}
	}()
	for {
		c, ok := a.take()
		if !ok {
			return
		}
		if ctx.Err() != nil {
			continue
		}
		var written uint32
		written, iov, scratch = b.process(ctx, c, iov, scratch)
		err := a.q.Push(c, written)
		left := a.inFlight.Add(-1)
		if err != nil {
			if !errors.Is(err, ErrStale) {
				b.log.Warn("request queue stopped", "err", err)
			}
			a.cancel()
			continue
		}
		if n := a.sinceNotify.Add(1); left == 0 || a.idle() || n >= blockNotifyBatch {
			a.sinceNotify.Store(0)
			a.q.Notify()
		}
	}
}

// process executes one request chain and writes its status byte (the last
// byte of the writable buffers). It returns the number of bytes written to
// the writable buffers, status included, and iov for the caller's next
// request (scratch for the vectored I/O). A chain with no writable byte has
// nowhere to report to: it is completed without being executed.
func (b *Block) process(ctx context.Context, c *Chain, iov [][]byte, scratch []byte) (uint32, [][]byte, []byte) {
	w := c.WritableLen()
	if w == 0 {
		return 0, iov, scratch
	}
	status, n, iov, scratch := b.execute(ctx, c, w-1, iov, scratch)
	last := c.Writable[len(c.Writable)-1]
	for i := len(c.Writable) - 1; len(last) == 0; i-- { // skip empty buffers
		last = c.Writable[i-1]
	}
	last[len(last)-1] = status
	return uint32(min(uint64(n)+1, uint64(w), 1<<32-1)), iov, scratch
}

// execute runs the request whose data-in part is the first dataIn bytes of
// the writable buffers. It returns the status and how many bytes of data it
// wrote to those buffers. Data moves with one preadv or pwritev per request
// (a guest's request is many page-sized buffers), straight between the
// image and guest memory; a source-backed disk reads straight into the
// request's buffer when one holds all its data, else into scratch (grown
// as needed, up to maxSourceRead, and returned for the next request) and
// copies out.
func (b *Block) execute(ctx context.Context, c *Chain, dataIn int, iov [][]byte, scratch []byte) (byte, int, [][]byte, []byte) {
	var hdr [blockHeaderSize]byte
	if blkGather(hdr[:], c.Readable) < blockHeaderSize {
		return BlockStatusIOErr, 0, iov, scratch
	}
	typ := binary.LittleEndian.Uint32(hdr[0:])
	sector := binary.LittleEndian.Uint64(hdr[8:])
	if b.slot {
		// Insert may fill the slot meanwhile.
		b.media.RLock()
		defer b.media.RUnlock()
	}
	if b.src != nil && typ == BlockTypeIn {
		if !b.inRange(sector, uint64(dataIn)) {
			return BlockStatusIOErr, 0, iov, scratch
		}
		off := int64(sector * BlockSectorSize)
		if len(c.Writable) > 0 && len(c.Writable[0]) >= dataIn {
			// One buffer holds the data (a page, or pages the guest's
			// memory has contiguous): read straight into guest memory.
			if _, err := b.src.ReadAt(ctx, c.Writable[0][:dataIn], off); err != nil {
				b.log.Debug("read failed", "sector", sector, "bytes", dataIn, "err", err)
				return BlockStatusIOErr, 0, iov, scratch
			}
			return BlockStatusOK, dataIn, iov, scratch
		}
		if want := min(dataIn, maxSourceRead); cap(scratch) < want {
			scratch = make([]byte, want)
		}
		for done := 0; done < dataIn; {
			buf := scratch[:min(dataIn-done, cap(scratch))]
			if _, err := b.src.ReadAt(ctx, buf, off+int64(done)); err != nil {
				b.log.Debug("read failed", "sector", sector, "bytes", dataIn, "err", err)
				return BlockStatusIOErr, done, iov, scratch
			}
			k := 0
			blkWalk(c.Writable, done, len(buf), func(p []byte) error {
				k += copy(p, buf[k:])
				return nil
			})
			done += k
		}
		return BlockStatusOK, dataIn, iov, scratch
	}
	st, n, iov := b.executeFile(c, typ, sector, dataIn, iov)
	return st, n, iov, scratch
}

// executeFile runs a request of type typ at sector on a file-backed disk
// (and the requests that need no data of a source-backed one).
func (b *Block) executeFile(c *Chain, typ uint32, sector uint64, dataIn int, iov [][]byte) (status byte, n int, _ [][]byte) {
	switch typ {
	case BlockTypeIn:
		if !b.inRange(sector, uint64(dataIn)) {
			return BlockStatusIOErr, 0, iov
		}
		iov = blkSlices(iov[:0], c.Writable, 0, dataIn)
		n, err := blkVectored(unix.Preadv, b.fd, iov, int64(sector*BlockSectorSize))
		if err != nil {
			b.log.Debug("read failed", "sector", sector, "err", err)
			return BlockStatusIOErr, n, iov
		}
		return BlockStatusOK, n, iov
	case BlockTypeOut:
		if b.readOnly {
			return BlockStatusIOErr, 0, iov
		}
		dataOut := c.ReadableLen() - blockHeaderSize
		if !b.inRange(sector, uint64(dataOut)) {
			return BlockStatusIOErr, 0, iov
		}
		iov = blkSlices(iov[:0], c.Readable, blockHeaderSize, dataOut)
		if _, err := blkVectored(unix.Pwritev, b.fd, iov, int64(sector*BlockSectorSize)); err != nil {
			b.log.Debug("write failed", "sector", sector, "err", err)
			return BlockStatusIOErr, 0, iov
		}
		return BlockStatusOK, 0, iov
	case BlockTypeFlush:
		if b.slot && b.readOnly { // a read-only volume takes no writes
			return BlockStatusIOErr, 0, iov
		}
		if b.file == nil { // a source-backed disk or an empty slot holds no writes
			return BlockStatusOK, 0, iov
		}
		if err := b.file.Sync(); err != nil {
			b.log.Warn("flush failed", "err", err)
			return BlockStatusIOErr, 0, iov
		}
		return BlockStatusOK, 0, iov
	case BlockTypeGetID:
		k := min(dataIn, BlockIDBytes)
		blkWalk(c.Writable, 0, k, func(buf []byte) error {
			n += copy(buf, b.id[n:])
			return nil
		})
		return BlockStatusOK, n, iov
	}
	return BlockStatusUnsupp, 0, iov
}

// blkMaxIov is the most buffers one preadv or pwritev takes (IOV_MAX).
const blkMaxIov = 1024

// blkVectored moves the whole of iov at off with op (unix.Preadv or
// unix.Pwritev), calling it again after a short transfer or EINTR. It
// returns the bytes moved; reading past the image's end is an error
// (io.ErrUnexpectedEOF), as is a write that moves nothing. iov's buffers
// are resliced as it goes.
func blkVectored(op func(int, [][]byte, int64) (int, error), fd int, iov [][]byte, off int64) (int, error) {
	total := 0
	for len(iov) > 0 {
		if len(iov[0]) == 0 {
			iov = iov[1:]
			continue
		}
		k, err := op(fd, iov[:min(len(iov), blkMaxIov)], off)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return total, err
		}
		if k == 0 {
			return total, io.ErrUnexpectedEOF
		}
		total += k
		off += int64(k)
		for k > 0 {
			m := min(k, len(iov[0]))
			iov[0] = iov[0][m:]
			k -= m
			if len(iov[0]) == 0 {
				iov = iov[1:]
			}
		}
	}
	return total, nil
}

// blkSlices appends to dst the pieces of the byte range [skip, skip+length)
// of the concatenation of bufs, in order; the range must lie inside bufs.
func blkSlices(dst, bufs [][]byte, skip, length int) [][]byte {
	blkWalk(bufs, skip, length, func(p []byte) error {
		dst = append(dst, p)
		return nil
	})
	return dst
}

// inRange reports whether a transfer of length bytes at sector is whole
// sectors that lie inside the disk.
func (b *Block) inRange(sector, length uint64) bool {
	if length%BlockSectorSize != 0 || sector > b.capacity {
		return false
	}
	return length/BlockSectorSize <= b.capacity-sector
}

// blkGather copies the start of bufs into p and returns how many bytes it
// copied.
func blkGather(p []byte, bufs [][]byte) int {
	n := 0
	for _, buf := range bufs {
		if n == len(p) {
			break
		}
		n += copy(p[n:], buf)
	}
	return n
}

// blkWalk calls fn on each piece of the byte range [skip, skip+length) of the
// concatenation of bufs, in order, stopping at the first error. The range
// must lie inside bufs.
func blkWalk(bufs [][]byte, skip, length int, fn func([]byte) error) error {
	for _, buf := range bufs {
		if length == 0 {
			return nil
		}
		if skip >= len(buf) {
			skip -= len(buf)
			continue
		}
		piece := buf[skip:]
		skip = 0
		if len(piece) > length {
			piece = piece[:length]
		}
		if err := fn(piece); err != nil {
			return err
		}
		length -= len(piece)
	}
	return nil
}
