%% What a message in pieces costs its receiver beyond a plain send: joining the
%% pieces (`iolist_to_binary/1') and, for a term that is not a binary, decoding it
%% (`binary_to_term/1'), for the seed's 10 MB message `{Pid, Binary}' cut into
%% pieces of convoy's default size; and the same message as a peer at protocol
%% version 3 gets it (kind `path': the pieces joined, only the small skeleton
%% decoded, see `convoy_chunk'). Fastest of 10, microseconds, in this process.
%% Run on its own:
%%
%%   erl -noshell -pa _build/bench/lib/convoy/ebin -pa _build/bench/lib/convoy/bench \
%%       -eval 'convoy_bench_chunk:copies(), halt().'
%%
%% `timeline/0' follows one such message between two nodes (a peer node it
%% starts, convoy on both with `chunk_guard => always'): the seed's message sent
%% by `!' and answered, the same by `convoy:send/2' in pieces, and, from a trace
%% of the sender (so a little slower), when its first piece was acknowledged, its
%% last, and when the receiver's inbox had joined, decoded and delivered it.
%% Medians of 5 messages after 20 for warm-up, microseconds:
%%
%%   erl -noshell -sname chunk_timeline -pa _build/bench/lib/convoy/ebin \
%%       -pa _build/bench/lib/convoy/bench -eval 'convoy_bench_chunk:timeline(), halt().'
%%
%% `cpu/0' measures what bulk in pieces costs in CPU, which is what bounds its
%% throughput on a machine whose cores the bulk keeps busy: `hol''s pattern (4
%% senders of the seed's 10 MB message, each waiting for its sink's answer, and
%% one small round trip after another beside them) between two peer nodes it
%% starts, for 3 s per variant, variants interleaved, 3 rounds. Per row: bulk
%% MB/s, the CPU time of each node's OS process (user + system, from
%% /proc/PID/stat, so Linux only) per MB moved, the share of the machine left
%% idle, the receiving node's minor page faults per MB, the small round trips'
%% count and median, and what the bulk senders were doing (`sender_state/1',
%% sampled every millisecond). `cpu/1' starts the peer nodes with extra emulator
%% flags (`cpu(["+MMscs", "1024"])'):
%%
%%   erl -noshell -sname chunk_cpu -pa _build/bench/lib/convoy/ebin \
%%       -pa _build/bench/lib/convoy/bench -eval 'convoy_bench_chunk:cpu(), halt().'
-module(convoy_bench_chunk).

-export([copies/0, timeline/0, sink/0, cpu/0, cpu/1, cpu_sender/4, cpu_prober/3,
         cpu_sampler/2, os_counts/0]).

-spec copies() -> ok.
copies() ->
    Msg = {self(), binary:copy(<<"b">>, 10000000)},
    PieceBytes = maps:get(chunk_bytes, convoy_config:defaults()),
    Arrived = fun(Paths) ->
                      {Kind, Io} = convoy_chunk:payload(Msg, Paths),
                      {_, Pieces} = convoy_chunk:pieces(Io, PieceBytes),
                      %% as they arrive: binaries of their own, not parts of the sender's
                      {Kind, [binary:copy(P) || P <- Pieces]}
              end,
    {term, TermPieces} = Arrived(false),
    {PathKind, PathPieces} = Arrived(true),
    Whole = iolist_to_binary(TermPieces),
    Rows = [{"cut (payload/2 + pieces/2)",
             fun() -> convoy_chunk:pieces(element(2, convoy_chunk:payload(Msg, true)),
                                          PieceBytes) end},
            {"join (iolist_to_binary/1)", fun() -> iolist_to_binary(TermPieces) end},
            {"decode (binary_to_term/1)", fun() -> binary_to_term(Whole) end},
            {"kind term: join + decode", fun() -> convoy_chunk:assemble(term, TermPieces) end},
            {"kind path: join + skeleton", fun() -> convoy_chunk:assemble(PathKind, PathPieces) end}],
    io:format("10 MB {Pid, Binary} in ~b pieces of ~b bytes:~n",
              [length(TermPieces), PieceBytes]),
    lists:foreach(fun({Label, F}) ->
                          Us = lists:min([element(1, timer:tc(F)) || _ <- lists:seq(1, 10)]),
                          io:format("  ~-32s ~8b us~n", [Label, Us])
                  end, Rows).

-spec timeline() -> ok.
timeline() ->
    Paths = ["-pa", filename:dirname(code:which(convoy)),
             "-pa", filename:dirname(code:which(?MODULE))],
    {ok, Peer, Node} = peer:start_link(#{name => peer:random_name(chunk_timeline),
                                         args => Paths}),
    Env = [{chunk_guard, always}],
    [ok = erpc:call(N, application, set_env, [convoy, K, V]) || N <- [node(), Node], {K, V} <- Env],
    [{ok, _} = erpc:call(N, application, ensure_all_started, [convoy]) || N <- [node(), Node]],
    Sink = spawn(Node, ?MODULE, sink, []),
    Msg = {self(), binary:copy(<<"b">>, 10000000)},
    Plain = fun() -> Sink ! Msg, receive true -> ok end end,
    Pieces = fun() -> convoy:send(Sink, Msg), receive true -> ok end end,
    [F() || _ <- lists:seq(1, 20), F <- [Plain, Pieces]],
    Rows = [{us(Plain), us(Pieces), traced(Pieces)} || _ <- lists:seq(1, 5)],
    Median = fun(L) -> round(convoy_bench_stats:median(L)) end,
    io:format("the seed's 10 MB {Pid, Binary}, sent and answered (median of 5, us):~n"),
    io:format("  ~-44s ~8b~n", ["whole, by !", Median([P || {P, _, _} <- Rows])]),
    io:format("  ~-44s ~8b~n", ["in pieces, by convoy:send/2", Median([C || {_, C, _} <- Rows])]),
    [io:format("  ~-44s ~8b~n", [Label, Median([element(I, T) || {_, _, T} <- Rows])])
     || {I, Label} <- [{1, "  traced: first piece acknowledged"},
                       {2, "  traced: last piece acknowledged"},
                       {3, "  traced: delivered (joined and decoded)"}]],
    application:stop(convoy),
    peer:stop(Peer).

%% @doc The timeline's sink: answers each binary with `is_binary/1' of it, by `!'.
-spec sink() -> no_return().
sink() ->
    receive {From, Bin} -> From ! is_binary(Bin) end,
    sink().

us(F) ->
    {Us, ok} = timer:tc(F),
    Us.

%% The send traced by a process of its own: when the acknowledgements of the
%% first and last pieces and the delivery arrived, in microseconds from the call.
traced(F) ->
    Self = self(),
    Tracer = spawn_link(fun() -> receive go -> Self ! {acks, acks([])} end end),
    erlang:trace(Self, true, ['receive', monotonic_timestamp, {tracer, Tracer}]),
    T0 = erlang:monotonic_time(),
    F(),
    erlang:trace(Self, false, ['receive']),
    Tracer ! go,
    Acks = receive {acks, Got} -> Got end,
    Since = fun(T) -> erlang:convert_time_unit(T - T0, native, microsecond) end,
    [{0, First} | _] = Acks,
    {_, Last} = lists:last([Ack || Ack = {Seq, _} <- Acks, is_integer(Seq)]),
    {delivered, Done} = lists:keyfind(delivered, 1, Acks),
    {Since(First), Since(Last), Since(Done)}.

acks(Acc) ->
    receive
        {trace_ts, _, 'receive', {_Alias, convoy_piece, What}, Ts} -> acks([{What, Ts} | Acc]);
        {trace_ts, _, 'receive', _Other, _Ts} -> acks(Acc)
    after 200 ->
        lists:reverse(Acc)
    end.

%%--------------------------------------------------------------------
%% cpu/0

-define(CPU_SECS, 3).
-define(CPU_BULK, 10000000).
%% What the senders were doing, as shares of samples (`sender_state/1').
-define(SENDER_STATES, [window, first, delivered, answer, suspended, working]).

-spec cpu() -> ok.
cpu() ->
    cpu([]).

%% @doc `cpu/0' with these emulator flags on both peer nodes, e.g.
%% `["+MMscs", "1024"]'.
-spec cpu([string()]) -> ok.
cpu(Flags) ->
    Paths = ["-pa", filename:dirname(code:which(convoy)),
             "-pa", filename:dirname(code:which(?MODULE))],
    Peers = [begin
                 {ok, P, N} = peer:start_link(#{name => peer:random_name(chunk_cpu),
                                                args => Paths ++ Flags}),
                 {ok, _} = erpc:call(N, application, ensure_all_started, [convoy]),
                 {P, N}
             end || _ <- [sender, sink]],
    [{_, A}, {_, B}] = Peers,
    true = erpc:call(A, net_kernel, connect_node, [B]),
    Variants = [{"plain `!`", plain, #{}},
                {"convoy, pieces of 63 KiB (default)", convoy, #{}},
                {"convoy, pieces of 64 KiB", convoy, #{chunk_bytes => 65536}},
                {"convoy, whole (chunk_threshold=infinity)", convoy,
                 #{chunk_threshold => infinity}}],
    Defaults = convoy_config:defaults(),
    Hz = list_to_integer(string:trim(os:cmd("getconf CLK_TCK"))),
    io:format("hol's pattern for ~b s per row: 4 senders of 10 MB, small round trips "
              "beside them; peer nodes' flags: ~s.~nB faults: the receiving node's minor "
              "page faults per MB moved.~nLast columns, the senders' time: waiting for an "
              "acknowledgement to open the window, for the first piece's, for "
              "`delivered',~nfor the sink's answer; suspended on a busy connection; "
              "working (sampled every ms)~n",
              [?CPU_SECS, lists:join(" ", ["none" || Flags =:= []] ++ Flags)]),
    io:format("  ~-42s ~8s ~9s ~9s ~9s ~8s ~6s ~7s ~9s ~s~n",
              ["variant", "MB/s", "A ms/MB", "B ms/MB", "ms/MB", "B faults", "idle", "rt",
               "rt p50",
               [io_lib:format(" ~6s", [K])
                || K <- ["window", "first", "deliv", "answer", "susp", "work"]]]),
    lists:foreach(
      fun(_Round) ->
              [begin
                   [ok = erpc:call(N, convoy, set_config, [maps:merge(Defaults, Cfg)])
                    || N <- [A, B]],
                   cpu_row(Label, Mode, A, B, Hz)
               end || {Label, Mode, Cfg} <- Variants]
      end, lists:seq(1, 3)),
    [peer:stop(P) || {P, _} <- Peers],
    ok.

cpu_row(Label, Mode, A, B, Hz) ->
    %% the harness's own sink (answers each binary) and server (answers `{req, ...}')
    Sinks = [spawn(B, convoy_bench_measure, bulk_sink, [Mode]) || _ <- lists:seq(1, 4)],
    Server = spawn(B, convoy_bench_measure, server, [Mode]),
    Counts0 = [erpc:call(N, ?MODULE, os_counts, []) || N <- [A, B]],
    Idle0 = idle_ticks(),
    T0 = erlang:monotonic_time(millisecond),
    %% the deadline by the sending node's clock: each node's monotonic time has
    %% its own origin
    Until = {self(), erpc:call(A, erlang, monotonic_time, [millisecond]) + ?CPU_SECS * 1000},
    Senders = [spawn(A, ?MODULE, cpu_sender, [Mode, S, ?CPU_BULK, Until]) || S <- Sinks],
    Prober = spawn(A, ?MODULE, cpu_prober, [Mode, Server, Until]),
    Sampler = spawn(A, ?MODULE, cpu_sampler, [Senders, #{}]),
    Sent = lists:sum([receive {done, P, N} -> N end || P <- Senders]),
    Sampler ! {stop, self()},
    Waits = receive {samples, Sampler, Counts} -> Counts end,
    Rts = receive {done, Prober, L} -> lists:sort(L) end,
    Secs = (erlang:monotonic_time(millisecond) - T0) / 1000,
    Counts1 = [erpc:call(N, ?MODULE, os_counts, []) || N <- [A, B]],
    [{TA, _}, {TB, FaultsB}] = [{(T1 - T) / Hz, F1 - F}
                                || {{T, F}, {T1, F1}} <- lists:zip(Counts0, Counts1)],
    Idle = (idle_ticks() - Idle0) / Hz / erlang:system_info(logical_processors_available)
        / Secs,
    [exit(P, kill) || P <- [Server | Sinks]],
    MB = max(Sent, 1) * ?CPU_BULK / 1.0e6,
    Total = max(1, lists:sum(maps:values(Waits))),
    io:format("  ~-42s ~8.1f ~9.3f ~9.3f ~9.3f ~8.1f ~5.1f% ~7b ~7b us ~s~n",
              [Label, Sent * ?CPU_BULK / 1.0e6 / Secs, TA * 1000 / MB, TB * 1000 / MB,
               (TA + TB) * 1000 / MB, FaultsB / MB, 100 * Idle, length(Rts),
               lists:nth(max(1, length(Rts) div 2), Rts ++ [0]),
               [io_lib:format(" ~5.1f%", [100 * maps:get(K, Waits, 0) / Total])
                || K <- ?SENDER_STATES]]).

%% @doc Every millisecond until told to stop, what each sender is doing
%% (`sender_state/1'); answers the counts.
-spec cpu_sampler([pid()], #{atom() => non_neg_integer()}) -> ok.
cpu_sampler(Senders, Counts) ->
    receive
        {stop, From} -> From ! {samples, self(), Counts}, ok
    after 1 ->
        cpu_sampler(Senders,
                    lists:foldl(fun(P, C) ->
                                        case sender_state(P) of
                                            gone -> C;
                                            K -> maps:update_with(K, fun(X) -> X + 1 end, 1, C)
                                        end
                                end, Counts, Senders))
    end.

%% What a bulk sender is doing: waiting for an acknowledgement to open its window,
%% for its first piece's, for its message's `delivered' or for its sink's answer,
%% suspended on a busy connection (or waiting for the helper that is), or working
%% (running or ready to).
sender_state(P) ->
    case erlang:process_info(P, [status, current_stacktrace]) of
        [{status, waiting}, {current_stacktrace, Stack}] ->
            Frames = [F || {convoy_chunk_send, F, _, _} <- Stack],
            %% a helper pushing a piece into the busy connection: as if suspended
            case {lists:member(busy_send, Frames), lists:member(stream, Frames),
                  lists:member(first, Frames), lists:member(finish, Frames)} of
                {true, _, _, _} -> suspended;
                {_, true, _, _} -> window;
                {_, _, true, _} -> first;
                {_, _, _, true} -> delivered;
                _ -> answer
            end;
        [{status, suspended}, _] -> suspended;
        [{status, _}, _] -> working;
        undefined -> gone
    end.

%% @doc This node's OS process: CPU clock ticks spent (user + system) and minor
%% page faults (a page the process touched for the first time, or again after
%% the runtime gave it back to the OS).
-spec os_counts() -> {non_neg_integer(), non_neg_integer()}.
os_counts() ->
    {ok, Stat} = file:read_file("/proc/" ++ os:getpid() ++ "/stat"),
    [_, AfterName] = binary:split(Stat, <<") ">>),
    %% fields 3 (state) on: minflt is field 10, utime 14, stime 15
    Fields = binary:split(AfterName, <<" ">>, [global]),
    {binary_to_integer(lists:nth(12, Fields)) + binary_to_integer(lists:nth(13, Fields)),
     binary_to_integer(lists:nth(8, Fields))}.

%% The machine's idle clock ticks, all processors (/proc/stat).
idle_ticks() ->
    {ok, Stat} = file:read_file("/proc/stat"),
    [Cpu | _] = binary:split(Stat, <<"\n">>),
    [_Label, _User, _Nice, _System, Idle | _] = binary:split(Cpu, <<" ">>, [global, trim_all]),
    binary_to_integer(Idle).

cpu_send(plain, To, Msg) -> erlang:send(To, Msg);
cpu_send(convoy, To, Msg) -> convoy:send(To, Msg).

%% @doc Sends its binary and waits for the answer until the deadline, then tells
%% the driver how many it sent.
-spec cpu_sender(plain | convoy, pid(), pos_integer(), {pid(), integer()}) -> ok.
cpu_sender(M, Sink, Size, {Driver, Deadline}) ->
    Msg = {self(), binary:copy(<<"b">>, Size)},
    Driver ! {done, self(), bulk_loop(M, Sink, Msg, Deadline, 0)},
    ok.

bulk_loop(M, Sink, Msg, Deadline, N) ->
    case erlang:monotonic_time(millisecond) >= Deadline of
        true ->
            N;
        false ->
            cpu_send(M, Sink, Msg),
            receive true -> ok end,
            bulk_loop(M, Sink, Msg, Deadline, N + 1)
    end.

%% @doc Small round trips until the deadline; tells the driver their durations (us).
-spec cpu_prober(plain | convoy, pid(), {pid(), integer()}) -> ok.
cpu_prober(M, Server, {Driver, Deadline}) ->
    Driver ! {done, self(), probe_loop(M, Server, {req, self(), ping}, Deadline, [])},
    ok.

probe_loop(M, Server, Req, Deadline, Acc) ->
    T = erlang:monotonic_time(microsecond),
    case T div 1000 >= Deadline of
        true ->
            Acc;
        false ->
            cpu_send(M, Server, Req),
            receive resp -> ok end,
            probe_loop(M, Server, Req, Deadline, [erlang:monotonic_time(microsecond) - T | Acc])
    end.
