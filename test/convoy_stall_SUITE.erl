%% A stalled peer (its OS process stopped with SIGSTOP) costs its senders at most
%% one wait each: fresh, streaming and marked senders, under each overload policy,
%% while the same senders also send to a healthy node; a peer that stalls and
%% resumes again and again; the node's mark clears once it answers.
-module(convoy_stall_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, groups/0, init_per_testcase/2, end_per_testcase/2]).
-export([error_at_bound_answers_at_once/1,
         fresh_senders_error/1, streaming_senders_drop/1, marked_senders_block/1,
         marked_senders_error/1, fresh_senders_send2/1,
         stalls_and_resumes_repeatedly/1, mark_clears_without_traffic/1,
         backlog_off_lane_heap/1]).
%% Run on peer nodes.
-export([collector/0]).

%% A call that took this long waited for something (barrier_timeout is 100 ms).
-define(SLOW_MS, 90).
%% Calls a sender may find slow in one stall: one wait for an answer, one for room
%% (policy block), and a margin for a loaded machine. Without a mark on the node
%% each of a marked sender's calls waited barrier_timeout.
-define(MAX_SLOW, 5).
-define(SENDERS, 8).
-define(SENDS, 2000).

all() ->
    [{group, stall}].

groups() ->
    [{stall, [], [error_at_bound_answers_at_once, fresh_senders_error, streaming_senders_drop,
                  marked_senders_block, marked_senders_error, fresh_senders_send2,
                  stalls_and_resumes_repeatedly, mark_clears_without_traffic,
                  backlog_off_lane_heap]}].

init_per_testcase(_TC, Config) ->
    _ = application:stop(convoy),
    Config.

end_per_testcase(_TC, _Config) ->
    convoy_ct_peers:stop_local().

%%--------------------------------------------------------------------
%% Cases

%% A sender that sent to B through its lane, B stopped, then the sender sends
%% with `overload => error' until the bound: it waits once (one barrier_timeout),
%% and at the bound each call answers `{error, overload}' at once.
error_at_bound_answers_at_once(_Config) ->
    start_convoy(#{max_buffered => 10000}),
    {PeerB, B} = convoy_peer(stall_b),
    SinkB = spawn(B, ?MODULE, collector, []),
    Sender = marked_sender(SinkB, 200),
    Oks = with_stalled(PeerB, fun() ->
        settle(), % the next send waits for a barrier
        Sender ! {until_refused, 1000, #{overload => error}},
        receive
            {done, Sender, #{slow := Slow, refused := Refused, max_refused_us := MaxUs,
                             oks := N}} ->
                ct:pal("~p ok before the bound, ~p refused; slow calls ~p; slowest "
                       "refusal ~p us", [N, Refused, Slow, MaxUs]),
                ?assert(Slow =< 2),
                ?assertEqual(1000, Refused),
                %% one refusal may be descheduled on a loaded machine: not 100 ms
                ?assert(MaxUs < ?SLOW_MS * 1000),
                #{stalled := St, unanswered := true, waited_us := W} = node_stats(B),
                ?assert(St >= 1),
                ?assert(W >= 90000),
                N
        after 30000 ->
            ct:fail(sender_held_by_stalled_node)
        end
    end),
    ok = convoy:flush(B),
    ?assertMatch({_, [], _}, await_count(SinkB, 100 + Oks)),
    await_unanswered(B, false).

fresh_senders_error(_Config) ->
    stall_run(fresh, #{overload => error}, #{max_buffered => 2000}).

streaming_senders_drop(_Config) ->
    stall_run(streaming, #{overload => drop}, #{max_buffered => 2000}).

marked_senders_block(_Config) ->
    stall_run(marked, #{overload => block, block_timeout => 300}, #{max_buffered => 2000}).

marked_senders_error(_Config) ->
    stall_run(marked, #{overload => error}, #{max_buffered => 2000}).

%% send/2: the default policy (block) and the default bounds.
fresh_senders_send2(_Config) ->
    stall_run(fresh, send2, #{}).

%% B stops and continues five times while a sender streams with pauses:
%% everything is delivered once and in order, and counted.
stalls_and_resumes_repeatedly(_Config) ->
    start_convoy(#{}),
    {PeerB, B} = convoy_peer(stall_b),
    SinkB = spawn(B, ?MODULE, collector, []),
    Self = self(),
    Payload = binary:copy(<<"r">>, 500),
    Sender = spawn_link(fun() -> paced_sender(Self, SinkB, Payload, 1, 0) end),
    OsPid = peer:call(PeerB, os, getpid, []),
    lists:foreach(fun(_) ->
                          os:cmd("kill -STOP " ++ OsPid),
                          receive after 500 -> ok end,
                          os:cmd("kill -CONT " ++ OsPid),
                          receive after 200 -> ok end
                  end, lists:seq(1, 5)),
    Sender ! stop,
    {Sent, Slow} = receive {paced, Sender, N, S} -> {N, S} after 30000 -> ct:fail(stuck) end,
    ct:pal("~p sent, ~p slow calls over 5 stalls", [Sent, Slow]),
    ?assert(Slow =< 5 + 3), % one wait per stall; without the mark, one per pause
    ok = convoy:flush(B),
    {Count, Errors, _} = await_count(SinkB, Sent),
    ?assertEqual([], Errors),
    ?assertEqual(Sent, Count),
    #{accepted := A, messages := M, dropped := 0, buffered := 0} = node_stats(B),
    ?assertEqual(A, M),
    await_unanswered(B, false).

%% A mark set when nobody sends to the node any more clears once it answers: the
%% marking sender asked its lane to probe, and the lane probes until it answers.
mark_clears_without_traffic(_Config) ->
    start_convoy(#{}),
    {PeerB, B} = convoy_peer(stall_b),
    SinkB = spawn(B, ?MODULE, collector, []),
    Sender = marked_sender(SinkB, 10),
    with_stalled(PeerB, fun() ->
        settle(), % the next send waits for a barrier
        Sender ! {send_one, self()},
        receive {sent, Sender} -> ok after 10000 -> ct:fail(sender_held) end,
        ?assertMatch(#{unanswered := true, stalled := 1}, node_stats(B))
    end),
    await_unanswered(B, false),
    ?assertMatch({101, [], _}, await_count(SinkB, 101)).

%% A stalled peer holds only its own node's lanes, and what waits behind its
%% connection waits in its lane's mailbox, off the lane's heap: B stopped, one
%% sender hands over 30,000 map messages of about 450 bytes (13 MB, beyond what
%% the stopped connection's buffers take). B's lane waits on the connection
%% (suspended), most of the messages in its mailbox, its heap a fraction of
%% theirs (about 2.5 M words as messages); C's lane goes on: a message to C
%% arrives meanwhile. Once B continues, everything arrives, once and in order.
backlog_off_lane_heap(_Config) ->
    start_convoy(#{}),
    {PeerB, B} = convoy_peer(stall_b),
    {_PeerC, C} = convoy_peer(stall_c),
    SinkB = spawn(B, ?MODULE, collector, []),
    SinkC = spawn(C, ?MODULE, collector, []),
    N = 30000,
    with_stalled(PeerB, fun() ->
        Sender = spawn_link(fun() ->
                                [ok = convoy:send(SinkB, {seq, self(), I, payload(I)})
                                 || I <- lists:seq(1, N)]
                            end),
        convoy_ct_peers:await(fun() -> is_process_alive(Sender) end, fun(A) -> not A end, 30000),
        LaneB = convoy_ct_peers:lane(B, 1),
        Info = convoy_ct_peers:await(
                 fun() -> maps:from_list(process_info(LaneB, [status, message_queue_len,
                                                             total_heap_size]))
                 end, fun(#{status := St}) -> St =:= suspended end, 10000),
        ct:pal("B's lane while B is stopped: ~p", [Info]),
        #{message_queue_len := Queued, total_heap_size := Heap} = Info,
        ?assert(Queued > N div 2),
        ?assert(Heap < 500000),
        ok = convoy:send(SinkC, {seq, self(), 1, payload(1)}),
        ?assertMatch({1, [], _}, await_count(SinkC, 1))
    end),
    ok = convoy:flush(B),
    {N, [], Seqs} = await_count(SinkB, N),
    ?assertEqual([lists:seq(1, N)], maps:values(Seqs)).

payload(I) ->
    #{<<"topic">> => <<"room:lobby">>, <<"ref">> => integer_to_binary(I),
      <<"body">> => binary:copy(<<"x">>, 300 + I rem 100), <<"seq">> => I}.

%%--------------------------------------------------------------------
%% One stall: B stopped, 8 senders each send 2,000 messages to B and as many to a
%% healthy C, pausing 2 ms after every 100. Each sender finishes with at most a few slow calls; C receives
%% everything while B is still stopped; once B continues, B receives what convoy
%% handed to distribution (for policies that report refusals, exactly the sends
%% that returned ok), once and in order, and B's counters add up.

stall_run(Kind, Policy, Settings) ->
    start_convoy(Settings),
    {PeerB, B} = convoy_peer(stall_b),
    {_PeerC, C} = convoy_peer(stall_c),
    SinksB = [spawn(B, ?MODULE, collector, []) || _ <- lists:seq(1, ?SENDERS)],
    SinksC = [spawn(C, ?MODULE, collector, []) || _ <- lists:seq(1, ?SENDERS)],
    Payload = binary:copy(<<"s">>, 2000),
    Self = self(),
    Progress = counters:new(1, []),
    Spawn = fun() ->
                    [spawn_link(fun() -> sender(Self, Kind, Policy, SB, SC, Payload, Progress) end)
                     || {SB, SC} <- lists:zip(SinksB, SinksC)]
            end,
    Before = case Kind of
                 fresh -> [];
                 _ -> [receive {ready, P} -> P end || P <- Spawn()]
             end,
    _ = Kind =:= marked andalso [await_count(S, 100) || S <- SinksB],
    _ = Kind =:= streaming andalso await_progress(Progress, ?SENDERS * 200),
    Results = with_stalled(PeerB, fun() ->
        Senders = case Kind of
                      fresh -> Spawn();
                      streaming -> Before;
                      marked -> settle(), Before
                  end,
        [P ! go || P <- Senders],
        Rs = [receive {done, P, R} -> R after 60000 -> ct:fail({held_by_stall, Kind, Policy}) end
              || P <- Senders],
        %% The healthy node got everything while B is still stopped.
        [?assertMatch({?SENDS, [], _}, await_count(S, ?SENDS)) || S <- SinksC],
        #{unanswered := Unanswered} = node_stats(B),
        ct:pal("~p ~p: B unanswered ~p; slow calls ~p; ok ~p",
               [Kind, Policy, Unanswered, [Slow || #{slow := Slow} <- Rs],
                [length(Oks) || #{oks := Oks} <- Rs]]),
        Rs
    end),
    [?assert(Slow =< ?MAX_SLOW) || #{slow := Slow} <- Results],
    ok = convoy:flush(B),
    #{accepted := A, messages := M, dropped := D, buffered := 0} = Stats = node_stats(B),
    ct:pal("B: ~p", [Stats]),
    ?assertEqual(A, M + D),
    %% everything handed to distribution arrives once B continues, nothing more
    convoy_ct_peers:await(fun() -> lists:sum([element(1, report(S)) || S <- SinksB]) end,
                          fun(N) -> N >= M end, 30000),
    Delivered = [seqs(S) || S <- SinksB],
    ?assertEqual(M, lists:sum([length(Seqs) || Seqs <- Delivered])),
    check_delivered(Policy, Results, Delivered),
    await_unanswered(B, false).

%% What B got, in order: exactly the sends that returned ok where refusals are
%% reported; where convoy drops and counts (send/2, `drop'), some of them.
check_delivered(Policy, Results, Delivered) ->
    [begin
         ?assertEqual(Seqs, lists:usort(Seqs)),
         case reports_refusals(Policy) of
             true -> ?assertEqual(Oks, Seqs);
             false -> ?assert(ordsets:is_subset(Seqs, Oks))
         end
     end || {Seqs, #{oks := Oks}} <- lists:zip(Delivered, Results)],
    ok.

reports_refusals(send2) -> false;
reports_refusals(#{overload := drop}) -> false;
reports_refusals(#{}) -> true.

sender(Parent, Kind, Policy, SinkB, SinkC, Payload, Progress) ->
    First = case Kind of
                marked ->
                    %% a burst through the lane: the sender is marked
                    [ok = send(SinkB, {seq, self(), I, Payload}, Policy) || I <- lists:seq(1, 100)],
                    true = convoy_sender:is_marked(node(SinkB)),
                    100;
                _ ->
                    0
            end,
    Parent ! {ready, self()},
    _ = Kind =:= streaming orelse receive go -> ok end, % a stream: the stall begins under it
    R = sends(SinkB, SinkC, Payload, Policy, Progress, First + 1, First + ?SENDS,
              #{slow => 0, oks => lists:reverse(lists:seq(1, First))}),
    _ = Kind =/= streaming orelse receive go -> ok end,
    Parent ! {done, self(), R#{oks := lists:reverse(maps:get(oks, R))}}.

sends(_SinkB, _SinkC, _Payload, _Policy, _Progress, I, Last, Acc) when I > Last ->
    Acc;
sends(SinkB, SinkC, Payload, Policy, Progress, I, Last, Acc = #{slow := Slow, oks := Oks}) ->
    T0 = erlang:monotonic_time(microsecond),
    R = send(SinkB, {seq, self(), I, Payload}, Policy),
    ok = convoy:send(SinkC, {seq, self(), I, small}),
    Us = erlang:monotonic_time(microsecond) - T0,
    counters:add(Progress, 1, 1),
    pause(I),
    Oks1 = case R of
               ok -> [I | Oks];
               {error, overload} -> Oks
           end,
    sends(SinkB, SinkC, Payload, Policy, Progress, I + 1, Last,
          Acc#{slow := Slow + slow(Us), oks := Oks1}).

%% Senders pause now and then, as most do: the lane settles, and a marked sender's
%% next message then waits for a barrier (each time, if nothing marks the node).
pause(I) when I rem 100 =:= 0 -> timer:sleep(2);
pause(_I) -> ok.

send(Sink, Msg, send2) -> convoy:send(Sink, Msg);
send(Sink, Msg, Opts) -> convoy:send(Sink, Msg, Opts).

slow(Us) when Us >= ?SLOW_MS * 1000 -> 1;
slow(_Us) -> 0.

%% Sends with a pause of 2 ms after every 50 (the lane settles between bursts, so
%% a marked sender's next message waits for a barrier), until told to stop.
paced_sender(Parent, Sink, Payload, I, Slow) ->
    receive
        stop -> Parent ! {paced, self(), I - 1, Slow}
    after 0 ->
        T0 = erlang:monotonic_time(microsecond),
        ok = convoy:send(Sink, {seq, self(), I, Payload}),
        Us = erlang:monotonic_time(microsecond) - T0,
        _ = I rem 50 =:= 0 andalso timer:sleep(2),
        paced_sender(Parent, Sink, Payload, I + 1, Slow + slow(Us))
    end.

%% A process that sent 100 messages to Sink through its lane (so it is marked),
%% then sends as told.
marked_sender(Sink, Bytes) ->
    Self = self(),
    Payload = binary:copy(<<"b">>, Bytes),
    Pid = spawn_link(fun() ->
                             [ok = convoy:send(Sink, {seq, self(), I, Payload})
                              || I <- lists:seq(1, 100)],
                             true = convoy_sender:is_marked(node(Sink)),
                             Self ! {marked, self()},
                             marked_loop(Self, Sink, Payload, 101)
                     end),
    receive {marked, Pid} -> ok after 10000 -> ct:fail(not_marked) end,
    await_count(Sink, 100),
    Pid.

marked_loop(Parent, Sink, Payload, I) ->
    receive
        {until_refused, N, Opts} ->
            R = until_refused(Sink, Payload, Opts, I, N, 0, #{slow => 0, oks => 0}),
            Parent ! {done, self(), R},
            marked_loop(Parent, Sink, Payload, I + maps:get(oks, R) + N);
        {send_one, ReplyTo} ->
            ok = convoy:send(Sink, {seq, self(), I, Payload}),
            ReplyTo ! {sent, self()},
            marked_loop(Parent, Sink, Payload, I + 1)
    end.

%% Sends until N calls were refused, timing each.
until_refused(_Sink, _Payload, _Opts, _I, N, N, Acc) ->
    Acc#{refused => N};
until_refused(Sink, Payload, Opts, I, N, Refused, Acc = #{slow := Slow, oks := Oks}) ->
    T0 = erlang:monotonic_time(microsecond),
    R = convoy:send(Sink, {seq, self(), I, Payload}, Opts),
    Us = erlang:monotonic_time(microsecond) - T0,
    Acc1 = Acc#{slow := Slow + slow(Us)},
    case R of
        ok ->
            until_refused(Sink, Payload, Opts, I + 1, N, Refused, Acc1#{oks := Oks + 1});
        {error, overload} ->
            until_refused(Sink, Payload, Opts, I + 1, N, Refused + 1,
                          Acc1#{max_refused_us => max(Us, maps:get(max_refused_us, Acc, 0))})
    end.

%%--------------------------------------------------------------------
%% Helpers

start_convoy(Settings) ->
    convoy_ct_peers:start_local(Settings).

convoy_peer(Name) ->
    convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(Name), #{}).

%% Long enough that a marked sender's next small send finds its lane settled and
%% sends with a barrier behind: the lane's gap and the sender's own gap per send
%% both exceed SETTLED_US, the sender's gap being divided by the SKIP_MAX + 1
%% sends its record may stand for (`convoy_path:marked_record/5'); twice that.
settle() ->
    #{'SETTLED_US' := Settled, 'SKIP_MAX' := Skips} = convoy_path:constants(),
    receive after 2 * Settled * (Skips + 1) div 1000 + 1 -> ok end.

%% A peer whose OS process is stopped (SIGSTOP) until Fun returns.
with_stalled(Peer, Fun) ->
    OsPid = peer:call(Peer, os, getpid, []),
    os:cmd("kill -STOP " ++ OsPid),
    try Fun() after os:cmd("kill -CONT " ++ OsPid) end.

node_stats(Node) ->
    maps:get(Node, maps:get(nodes, convoy:info())).

await_unanswered(Node, Value) ->
    convoy_ct_peers:await(fun() -> maps:get(unanswered, node_stats(Node)) end,
                          fun(V) -> V =:= Value end, 20000).

await_progress(Progress, N) ->
    convoy_ct_peers:await(fun() -> counters:get(Progress, 1) end, fun(V) -> V >= N end, 20000).

%% collector: per sender, the sequence numbers received, in arrival order.
collector() ->
    collector(#{}, 0).

collector(Seqs, Count) ->
    receive
        {seq, From, Seq, _Payload} ->
            collector(Seqs#{From => [Seq | maps:get(From, Seqs, [])]}, Count + 1);
        {report, ReplyTo} ->
            ReplyTo ! {report, self(), Count, maps:map(fun(_, L) -> lists:reverse(L) end, Seqs)},
            collector(Seqs, Count)
    end.

report(C) ->
    C ! {report, self()},
    receive {report, C, Count, Seqs} -> {Count, Seqs}
    after 20000 -> ct:fail({no_report, C})
    end.

%% Wait until the collector has N messages: {Count, senders out of order, Seqs}.
await_count(C, N) ->
    {Count, Seqs} = convoy_ct_peers:await(fun() -> report(C) end,
                                          fun({Cnt, _}) -> Cnt >= N end, 30000),
    Errors = [From || {From, L} <- maps:to_list(Seqs), L =/= lists:usort(L)],
    {Count, Errors, Seqs}.

%% The sequence numbers of C's one sender.
seqs(C) ->
    case maps:values(element(2, report(C))) of
        [L] -> L;
        [] -> []
    end.
