"""After the run: the HTML report, the run's summary as data, and the comparison of two runs,
all from the ranks' history databases and state files (ddpmon/state/). Never imports torch.

    from ddpmon.report import run, summary, html
    r = run.load(["/tmp/ddpmon-1000/myjob"])
    s = summary.summarize(r)
    open("report.html", "w").write(html.render(r, s))
"""
