"""Compare two lm-eval runs' logged samples (--log_samples) answer by answer: the generated texts
must be equal and each choice's loglikelihood within 1e-3. Called by scripts/check_lm_eval.sh.

    python scripts/compare_lm_eval_samples.py SERVER_OUTPUT_DIR HF_OUTPUT_DIR
"""
import glob
import json
import sys

TOLERANCE = 1e-3


def answers(folder: str) -> dict:
    """(task file, doc_id) -> the sample's resps."""
    out = {}
    for path in glob.glob(f"{folder}/**/samples_*.jsonl", recursive=True):
        task = path.rsplit("samples_", 1)[1].rsplit("_", 1)[0]
        with open(path) as f:
            for line in f:
                sample = json.loads(line)
                out[(task, sample["doc_id"])] = sample["resps"]
    return out


def main(server_dir: str, hf_dir: str) -> int:
    server, hf = answers(server_dir), answers(hf_dir)
    if not server or server.keys() != hf.keys():
        print(f"the runs answered different documents ({len(server)} vs {len(hf)})")
        return 1
    worst, bad = 0.0, []
    for key, resps in server.items():
        for ours, ref in zip(resps, hf[key]):
            if isinstance(ours[0], str):  # generate_until: [text]
                if ours[0] != ref[0]:
                    bad.append((key, ours[0], ref[0]))
            else:  # loglikelihood: [[logprob, is_greedy]]
                worst = max(worst, abs(float(ours[0][0]) - float(ref[0][0])))
                if ours[0][1] != ref[0][1]:
                    bad.append((key, ours[0], ref[0]))
    print(f"{len(server)} documents, {len(bad)} different answers; "
          f"largest loglikelihood difference {worst:.2e}")
    for item in bad[:10]:
        print("  ", item)
    return 0 if not bad and worst < TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
