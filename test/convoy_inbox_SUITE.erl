%% What an inbox does with batches that are well-formed but ask too much of it, with
%% peer nodes: barriers naming a process on a third node. Batches are built by hand
%% (the wire format in convoy_wire), as a stray or malformed one would arrive.
-module(convoy_inbox_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, suite/0, init_per_testcase/2, end_per_testcase/2]).
-export([barrier_for_third_node/1]).
%% Run on peer nodes, or spawned.
-export([recorder/0, send_with_barrier/3]).

-define(INBOX, convoy_inbox_1).

suite() ->
    [{timetrap, {seconds, 120}}].

all() ->
    [barrier_for_third_node].

init_per_testcase(_TC, Config) ->
    _ = application:stop(convoy),
    {ok, _} = application:ensure_all_started(convoy),
    Config.

end_per_testcase(_TC, _Config) ->
    _ = application:stop(convoy),
    ok.

%%--------------------------------------------------------------------
%% Test cases

%% A barrier's ReplyTo must be a process (pid or alias) of the node the batch comes
%% from. A batch from A whose barriers name a process on C used to make this node's
%% inbox send to C on A's behalf; now they are bad entries and C gets nothing. A
%% barrier for A itself is still answered.
barrier_for_third_node(_Config) ->
    {PeerA, A} = peer(?CT_PEER_NAME(sender_a)),
    {_PeerC, C} = peer(?CT_PEER_NAME(third_c)),
    Rec = spawn(C, ?MODULE, recorder, []),
    AliasC = ask(Rec, alias),
    Inbox = whereis(?INBOX),
    Before = rejected(),
    Entries = [{'$convoy_barrier', Rec, to_c_pid}, {'$convoy_barrier', AliasC, to_c_alias}],
    ?assertEqual(ok, peer:call(PeerA, ?MODULE, send_with_barrier, [{?INBOX, node()}, A, Entries])),
    ?assertEqual(2, maps:get(bad_entry, rejected()) - maps:get(bad_entry, Before)),
    %% Anything the inbox sent to C before answering A travels on this node's
    %% connection to C ahead of this probe.
    Rec ! probe,
    ?assertEqual([probe], ask(Rec, received)),
    ?assertEqual(Inbox, whereis(?INBOX)).

%%--------------------------------------------------------------------
%% Helpers

peer(Name) ->
    convoy_ct_peers:start(?MODULE, Name, #{}).

batch(From, Entries) ->
    {'$convoy', 1, batch, From, Entries}.

rejected() ->
    maps:get(rejected, convoy:info()).

%% Send Entries and then a barrier for this process as a batch from node From to
%% Inbox; ok once the barrier is answered (everything before it is delivered).
send_with_barrier(Inbox, From, Entries) ->
    Tag = make_ref(),
    Inbox ! batch(From, Entries ++ [{'$convoy_barrier', self(), Tag}]),
    receive
        {Tag, convoy_barrier} -> ok
    after 20000 ->
        barrier_timeout
    end.

%% recorder: keeps what it receives; answers `{'$q', alias | received, From}'.
recorder() ->
    recorder([], alias()).

recorder(Got, Alias) ->
    receive
        {'$q', alias, From} ->
            From ! {'$a', self(), Alias},
            recorder(Got, Alias);
        {'$q', received, From} ->
            From ! {'$a', self(), lists:reverse(Got)},
            recorder(Got, Alias);
        M ->
            recorder([M | Got], Alias)
    end.

ask(Rec, What) ->
    Rec ! {'$q', What, self()},
    receive {'$a', Rec, A} -> A after 10000 -> ct:fail({no_answer, Rec, What}) end.
