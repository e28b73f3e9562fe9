package networkpolicy

// Added to sigs.k8s.io/kube-network-policies by scripts/build-node.sh: packets go to
// user space through the xtables NFQUEUE target (nft_compat) rather than nftables'
// own `queue` statement, which kernels built without CONFIG_NFT_QUEUE lack. Same
// queue, same bypass flag; the rule is otherwise unchanged.

import (
	"encoding/binary"

	"github.com/google/nftables/expr"
	"github.com/google/nftables/xt"
)

// nfqFlagBypass is NFQ_FLAG_BYPASS of struct xt_NFQ_info_v3.
const nfqFlagBypass = 0x01

func nfqueueTarget(num uint16, bypass bool) *expr.Target {
	// struct xt_NFQ_info_v3 { __u16 queuenum; __u16 queues_total; __u16 flags; }
	info := make([]byte, 6)
	binary.NativeEndian.PutUint16(info[0:], num)
	binary.NativeEndian.PutUint16(info[2:], 1)
	if bypass {
		binary.NativeEndian.PutUint16(info[4:], nfqFlagBypass)
	}
	payload := xt.Unknown(info)
	return &expr.Target{Name: "NFQUEUE", Rev: 3, Info: &payload}
}
