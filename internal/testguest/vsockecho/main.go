// Command vsockecho is a guest program for Kiln's virtio-vsock tests. It
// listens on a vsock port and echoes every connection back until the peer
// closes its side; it can also dial the host (CID 2) once, send a message,
// and print the reply; and it exits when something connects to its exit
// port. It uses raw AF_VSOCK sockets and is built with CGO_ENABLED=0 so it
// runs in a bare initramfs.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

func main() {
	listen := flag.Uint("listen", 1234, "vsock port to echo on")
	exitPort := flag.Uint("exit-port", 0, "vsock port whose first connection makes the program exit (0: none)")
	dial := flag.Uint("dial", 0, "host vsock port to dial once (0: none)")
	msg := flag.String("msg", "hello", "message to send when dialling")
	flag.Parse()

	ln, err := listenVsock(uint32(*listen))
	if err != nil {
		fatal(err)
	}
	go serve(ln, echo)
	if *exitPort != 0 {
		ex, err := listenVsock(uint32(*exitPort))
		if err != nil {
			fatal(err)
		}
		go serve(ex, func(f *os.File) {
			fmt.Println("vsockecho: exit requested")
			os.Exit(0)
		})
	}
	fmt.Printf("vsockecho: listening on %d\n", *listen)
	if *dial != 0 {
		reply, err := dialHost(uint32(*dial), *msg)
		if err != nil {
			fmt.Printf("vsockecho: dial %d: %v\n", *dial, err)
		} else {
			fmt.Printf("vsockecho: dial reply %q\n", reply)
		}
	}
	select {}
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "vsockecho:", err)
	os.Exit(1)
}

// listenVsock returns a listening stream socket on port, any CID.
func listenVsock(port uint32) (int, error) {
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrVM{CID: unix.VMADDR_CID_ANY, Port: port}); err != nil {
		return -1, fmt.Errorf("bind port %d: %w", port, err)
	}
	if err := unix.Listen(fd, 128); err != nil {
		return -1, fmt.Errorf("listen on port %d: %w", port, err)
	}
	return fd, nil
}

// serve accepts connections on the blocking socket ln forever.
func serve(ln int, handle func(*os.File)) {
	for {
		fd, _, err := unix.Accept4(ln, unix.SOCK_CLOEXEC)
		if errors.Is(err, unix.EINTR) || errors.Is(err, unix.ECONNABORTED) {
			continue
		}
		if err != nil {
			fatal(fmt.Errorf("accept: %w", err))
		}
		f, err := socketFile(fd)
		if err != nil {
			fatal(err)
		}
		go handle(f)
	}
}

// socketFile wraps a connected socket for the runtime's poller.
func socketFile(fd int) (*os.File, error) {
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("set non-blocking: %w", err)
	}
	return os.NewFile(uintptr(fd), "vsock"), nil
}

// shutdownWrite half-closes f.
func shutdownWrite(f *os.File) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.Shutdown(int(fd), unix.SHUT_WR) }); err != nil {
		return err
	}
	return serr
}

// echo writes back everything it reads, then closes.
func echo(f *os.File) {
	defer f.Close()
	buf := make([]byte, 64<<10)
	for {
		n, err := f.Read(buf)
		if n > 0 {
			if _, werr := f.Write(buf[:n]); werr != nil {
				fmt.Println("vsockecho: write:", werr)
				return
			}
		}
		if err != nil {
			if err != io.EOF {
				fmt.Println("vsockecho: read:", err)
			}
			break
		}
	}
	if err := shutdownWrite(f); err != nil {
		fmt.Println("vsockecho: shutdown:", err)
	}
}

// dialHost connects to the host's port, sends msg, half-closes and returns
// what the host answers before it closes.
func dialHost(port uint32, msg string) (string, error) {
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("socket: %w", err)
	}
	err = unix.Connect(fd, &unix.SockaddrVM{CID: unix.VMADDR_CID_HOST, Port: port})
	for errors.Is(err, unix.EINTR) || errors.Is(err, unix.EALREADY) {
		// Interrupted: the connection goes on; wait for its result.
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		if _, perr := unix.Poll(pfd, -1); errors.Is(perr, unix.EINTR) {
			continue
		} else if perr != nil {
			err = perr
			break
		}
		var soerr int
		soerr, err = unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
		if err == nil && soerr != 0 {
			err = unix.Errno(soerr)
		}
	}
	if err != nil {
		unix.Close(fd)
		return "", fmt.Errorf("connect: %w", err)
	}
	f, err := socketFile(fd)
	if err != nil {
		return "", err
	}
	defer f.Close()
	if _, err := io.WriteString(f, msg); err != nil {
		return "", fmt.Errorf("write: %w", err)
	}
	if err := shutdownWrite(f); err != nil {
		return "", fmt.Errorf("shutdown: %w", err)
	}
	reply, err := io.ReadAll(io.LimitReader(f, 4096))
	if err != nil {
		return "", fmt.Errorf("read: %w", err)
	}
	return string(reply), nil
}
